/* fa_ring over NCCL (include/flashattn_nccl.h): each exchange waits for the
 * caller's stream, runs as one ncclGroup of a send and a receive on the
 * transfers' stream, and records an event the caller's stream waits on. */
#include "flashattn_nccl.h"

static fa_status nccl_exchange(void *ctx, const void *send, int send_to, void *recv, int recv_from,
                               size_t bytes, void *stream) {
  fa_ring_nccl *n = ctx;
  if (cudaEventRecord(n->ready, (cudaStream_t)stream) != cudaSuccess ||
      cudaStreamWaitEvent(n->stream, n->ready, 0) != cudaSuccess)
    return FA_ERR_DEVICE;
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) r = ncclSend(send, bytes, ncclChar, send_to, n->comm, n->stream);
  if (r == ncclSuccess) r = ncclRecv(recv, bytes, ncclChar, recv_from, n->comm, n->stream);
  const ncclResult_t e = ncclGroupEnd();
  if (r == ncclSuccess) r = e;
  if (r != ncclSuccess) {
    n->last_result = r;
    return FA_ERR_DEVICE;
  }
  return cudaEventRecord(n->done, n->stream) == cudaSuccess ? FA_OK : FA_ERR_DEVICE;
}

/* The transfers' stream runs in order: its last event covers every exchange. */
static fa_status nccl_wait(void *ctx, void *stream) {
  fa_ring_nccl *n = ctx;
  return cudaStreamWaitEvent((cudaStream_t)stream, n->done, 0) == cudaSuccess ? FA_OK
                                                                              : FA_ERR_DEVICE;
}

fa_status fa_ring_nccl_init(fa_ring_nccl *net, fa_ring *ring, ncclComm_t comm,
                            fa_ring_layout layout) {
  if (!net || !ring || !comm) return FA_ERR_INVALID_ARGUMENT;
  int rank = 0, size = 0;
  net->comm = comm;
  net->last_result = ncclSuccess;
  net->stream = NULL;
  net->ready = net->done = NULL;
  if ((net->last_result = ncclCommUserRank(comm, &rank)) != ncclSuccess ||
      (net->last_result = ncclCommCount(comm, &size)) != ncclSuccess)
    return FA_ERR_DEVICE;
  if (cudaStreamCreateWithFlags(&net->stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&net->ready, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&net->done, cudaEventDisableTiming) != cudaSuccess) {
    fa_ring_nccl_destroy(net);
    return FA_ERR_DEVICE;
  }
  /* done starts recorded: a wait before any exchange returns at once */
  if (cudaEventRecord(net->done, net->stream) != cudaSuccess) {
    fa_ring_nccl_destroy(net);
    return FA_ERR_DEVICE;
  }
  ring->rank = rank;
  ring->size = size;
  ring->layout = layout;
  ring->ctx = net;
  ring->exchange = nccl_exchange;
  ring->wait = nccl_wait;
  return FA_OK;
}

void fa_ring_nccl_destroy(fa_ring_nccl *net) {
  if (!net) return;
  if (net->done) cudaEventDestroy(net->done);
  if (net->ready) cudaEventDestroy(net->ready);
  if (net->stream) cudaStreamDestroy(net->stream);
  net->done = net->ready = NULL;
  net->stream = NULL;
}
