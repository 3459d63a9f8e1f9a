/* flashattn over NCCL: an fa_ring whose exchanges are ncclSend/ncclRecv pairs
 * on a stream of their own, so the transfers of one step overlap the
 * attention of the step on the caller's stream (fa_params.stream).
 *
 *   fa_ring_nccl net;
 *   fa_ring ring;
 *   fa_ring_nccl_init(&net, &ring, comm, FA_RING_ZIGZAG);   // rank, size from comm
 *   fa_ring_forward(&params, &ring, &q, &k, &v, &o, lse);    // params.device = CUDA
 *   fa_ring_nccl_destroy(&net);
 *
 * Built as libflashattn_nccl (linking NCCL) when CMake finds NCCL; the
 * library itself needs no NCCL. One fa_ring_nccl per communicator and
 * thread; its stream and events belong to the communicator's device. */
#ifndef FLASHATTN_NCCL_H
#define FLASHATTN_NCCL_H

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "flashattn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fa_ring_nccl {
  ncclComm_t comm;
  cudaStream_t stream;      /* the transfers' stream */
  cudaEvent_t ready, done;  /* the caller's work before a transfer; the last transfer */
  ncclResult_t last_result; /* of the last failing NCCL call (ncclSuccess if none) */
} fa_ring_nccl;

/* Fills net (a stream and two events on the current device) and ring (rank
 * and size from comm, the layout given, the callbacks). */
fa_status fa_ring_nccl_init(fa_ring_nccl *net, fa_ring *ring, ncclComm_t comm,
                            fa_ring_layout layout);
void fa_ring_nccl_destroy(fa_ring_nccl *net);

#ifdef __cplusplus
}
#endif

#endif /* FLASHATTN_NCCL_H */
