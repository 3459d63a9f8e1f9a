/* Tensors the flash kernels cannot read or write in place: rows that do not
 * start on 16-byte boundaries (a head dim that is not a multiple of 8 with
 * rows back to back, a pointer into the middle of a row, odd strides). The
 * kernels move rows in 16-byte chunks (cp.async, the tensor copy engine), so
 * such a tensor goes through a padded copy in the workspace: (batch, seqlen,
 * heads, dp) contiguous, dp = d rounded up to 8. Inputs are copied in before
 * the kernels run, outputs copied back after them; tensors already aligned
 * are used where they are. */
#ifndef FA_CUDA_REPACK_CUH
#define FA_CUDA_REPACK_CUH

#include <cuda_runtime.h>

#include "common/problem.h"

namespace fa {

/* The copies of pass `pass` (FA_PASS_FORWARD: q, k, v in, o out;
 * FA_PASS_BACKWARD: q, k, v, o, dout in, dq, dk, dv out) live in the
 * workspace after the kernels' own base bytes (a multiple of 256). A tensor
 * not given yet (fa_workspace_size sees only q, k, v: headdim 0) is taken to
 * have rows back to back at an aligned address, as freshly allocated ones
 * do: copied iff the head dim is not a multiple of 8. Outputs are copied in
 * too where the kernels leave some of their rows as they were (varlen rows
 * past the last sequence, a KV cache's unused keys).
 *
 * The workspace of the pass: base plus the copies. */
size_t repack_workspace(const fa_problem *pb, fa_pass pass, size_t base);
/* run(view) on the problem with its copies in place of the tensors that need
 * them, the copies made before and after it (workspace: base bytes for run,
 * then the copies). */
fa_status repack_around(const fa_problem *pb, fa_pass pass, size_t base,
                        fa_status (*run)(const fa_problem *view));

}  // namespace fa

#endif
