/* The float32 standard attention of standard_fast.c: what fa_ref_forward and
 * fa_ref_backward run for f32/f16/bf16 storage; float64 stays on the oracle. */
#ifndef FA_REF_STANDARD_FAST_H
#define FA_REF_STANDARD_FAST_H

#include "common/problem.h"

size_t fa_ref_fast_forward_workspace(const fa_problem *pb);
fa_status fa_ref_fast_forward(const fa_problem *pb);
size_t fa_ref_fast_backward_workspace(const fa_problem *pb);
fa_status fa_ref_fast_backward(const fa_problem *pb);

#endif
