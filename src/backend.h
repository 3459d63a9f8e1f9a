/* The interface every backend implements. src/api.c validates the arguments,
 * fills an fa_problem and calls exactly one of these; backends never validate
 * user input again. Each *_workspace function returns the bytes its matching
 * call needs in fa_problem.workspace (the api allocates it if the user did not). */
#ifndef FA_BACKEND_H
#define FA_BACKEND_H

#include "common/problem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Standard attention (Algorithm 0) on the CPU; f32/f16/bf16 and f64 storage. */
size_t fa_ref_forward_workspace(const fa_problem *pb);
size_t fa_ref_backward_workspace(const fa_problem *pb);
fa_status fa_ref_forward(const fa_problem *pb);
fa_status fa_ref_backward(const fa_problem *pb);
/* fa_attention_probs on the CPU (any storage dtype; float64 arithmetic). */
size_t fa_ref_probs_workspace(const fa_problem *pb);
fa_status fa_ref_probs(const fa_problem *pb);

/* Tiled FlashAttention on the CPU (flash1 and flash2 orders). */
size_t fa_cpu_forward_workspace(const fa_problem *pb);
size_t fa_cpu_backward_workspace(const fa_problem *pb);
fa_status fa_cpu_forward(const fa_problem *pb);
fa_status fa_cpu_backward(const fa_problem *pb);

/* The KV-cache call's first step in host memory (common/kvcache.c): q
 * rotated into fa_problem.q, the new rows appended to the caches. */
fa_status fa_host_kvcache_prepare(const fa_problem *pb);

/* CUDA backend (only when built with FLASHATTN_CUDA). */
int fa_cuda_available(void);
fa_status fa_cuda_check(const fa_problem *pb, fa_pass pass); /* what this build supports */
size_t fa_cuda_forward_workspace(const fa_problem *pb);
size_t fa_cuda_backward_workspace(const fa_problem *pb);
fa_status fa_cuda_forward(const fa_problem *pb);
fa_status fa_cuda_backward(const fa_problem *pb);
fa_status fa_cuda_probs(const fa_problem *pb); /* no workspace */
fa_status fa_cuda_alloc(void **ptr, size_t bytes, void *stream);
void fa_cuda_free(void *ptr, void *stream);

/* Ring attention's elementwise steps (src/ring.c), on each device; tensors of
 * one shape (lse-shaped ones as headdim 1), float32 accumulators.
 *   ring_add: dst = src (or fill, src NULL), plus dst's old value if accumulate
 *   ring_merge: (acc, lacc) = their log-sum-exp merge with (o, l); a row whose
 *     l is -inf is left as it was, one whose lacc is -inf takes (o, l) */
fa_status fa_cpu_ring_add(const fa_tensor *dst, const fa_tensor *src, int accumulate, float fill,
                          int num_threads);
fa_status fa_cpu_ring_merge(const fa_tensor *acc, const fa_tensor *lacc, const fa_tensor *o,
                            const fa_tensor *l, int num_threads);
fa_status fa_cuda_ring_add(const fa_tensor *dst, const fa_tensor *src, int accumulate, float fill,
                           void *stream);
fa_status fa_cuda_ring_merge(const fa_tensor *acc, const fa_tensor *lacc, const fa_tensor *o,
                             const fa_tensor *l, void *stream);

/* t (named name) is a valid tensor of like's shape and dtype, with data; as an
 * output, its strides do not make elements overlap (api.c's rules). */
fa_status fa_check_like(const fa_tensor *t, const char *name, int is_output, const fa_tensor *like,
                        const char *like_name);

/* Sets the thread's last-error message (printf-style) and returns status. */
fa_status fa_set_error(fa_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#ifdef __cplusplus
}
#endif

#endif
