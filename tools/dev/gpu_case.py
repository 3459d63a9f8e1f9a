#!/usr/bin/env python3
"""One decode step, prefill chunk or short causal forward, a few calls of it, for a
profiler to capture: our forward over a contiguous or paged cache (tools/bench_paged.py's
shapes: bf16, D = 128, 32 query heads on 8 K/V heads; decode: batch 16, one row, 8k keys;
prefill: batch 1, 256 causal rows, 8k keys; short: B32 H16 N512 D64 f16 causal, no cache),
or cuDNN's (SDPA) on the same tensors. Three warm-up calls, then one more, so that
`--launch-skip 3 -c 1` captures a warm call:

  ncu --set full -k regex:fwd_kernel --launch-skip 3 -c 1 -o prefill_p256 \\
      python3 tools/dev/gpu_case.py prefill --page 256 --lib build-gpu/libflashattn.so
  ncu -k regex:'sdpa|fprop|cudnn|fmha' --launch-skip 1 -c 2 \\
      python3 tools/dev/gpu_case.py decode --cudnn --lib build-gpu/libflashattn.so
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
sys.path.insert(0, os.path.join(here, "..", "peers"))
from bench_paged import Case  # noqa: E402
from bench_sdpa import Ours  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=["decode", "prefill", "short"])
    ap.add_argument("--lib", default="build-gpu/libflashattn.so", help="path of libflashattn.so")
    ap.add_argument("--page", type=int, default=0, help="page size (0: a contiguous cache)")
    ap.add_argument("--cudnn", action="store_true", help="SDPA's cuDNN backend instead of ours")
    ap.add_argument("--dense", action="store_true",
                    help="our forward without seqused_k (every key used; a plain K/V map)")
    ap.add_argument("--keys", type=int, default=8192)
    a = ap.parse_args()
    ours = Ours(a.lib)
    torch.manual_seed(0)
    if a.shape == "short":
        q, k, v = (torch.randn(32, 16, 512, 64, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        sdpa_args, sdpa_kw = (q, k, v), {"is_causal": True}
        call = lambda: ours.forward(q, k, v, True)  # noqa: E731
    else:
        if a.shape == "prefill":
            c = Case(ours.lib, 1, 32, 8, 128, 256, a.keys, True)
        else:
            c = Case(ours.lib, 16, 32, 8, 128, 1, a.keys, False)
        # non-causal: SDPA's causal is top-left aligned
        sdpa_args, sdpa_kw = [x.transpose(1, 2) for x in (c.q, c.k, c.v)], {"enable_gqa": True}
        # its pool, its workspace
        call = None if a.cudnn else c.call(a.page, False, False, not a.dense)
    if a.cudnn:
        def call():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(*sdpa_args, **sdpa_kw)
    for _ in range(4):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
