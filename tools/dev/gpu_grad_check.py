#!/usr/bin/env python3
"""Long-sequence accuracy on the GPU: output and gradients of ours and of SDPA's flash
backend against float64 math attention, at training shapes (what the unit tests' small
sizes cannot show). Run where the Python package can find libflashattn.so, e.g.
  FLASHATTN_LIBRARY=build-gpu/libflashattn.so PYTHONPATH=python python3 tools/dev/gpu_grad_check.py
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def main():
    torch.manual_seed(0)
    shapes = [(8, 1024, 12, 64), (2, 4096, 12, 64), (1, 8192, 8, 128)]
    print("%-22s %-6s %-9s %9s %9s %9s %9s" % ("B,N,H,D", "causal", "impl", "O", "dQ", "dK", "dV"))
    worst = 0.0
    for (B, N, H, D) in shapes:
        for causal in (True, False):
            q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                           for _ in range(4))
            ref_in = [t.double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.MATH):
                ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal)
            ref.backward(do.double().transpose(1, 2))
            want = [ref.transpose(1, 2)] + [t.grad.transpose(1, 2) for t in ref_in]
            res = {}
            for impl in ("flashattn", "sdpa-flash"):
                xs = [t.clone().requires_grad_() for t in (q, k, v)]
                if impl == "flashattn":
                    out = flashattn.flash_attn_func(*xs, causal=causal)
                else:
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        out = F.scaled_dot_product_attention(
                            *[x.transpose(1, 2) for x in xs], is_causal=causal).transpose(1, 2)
                out.backward(do)
                errs = [rel(out, want[0])] + [rel(x.grad, w) for x, w in zip(xs, want[1:])]
                res[impl] = errs
                print("%-22s %-6s %-9s %9.2e %9.2e %9.2e %9.2e" % (
                    (B, N, H, D), causal, impl, *errs))
            worst = max(worst, max(a / b for a, b in zip(res["flashattn"], res["sdpa-flash"])))
    print("worst ratio of our error to SDPA flash's: %.2f" % worst)
    return 0 if worst < 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
