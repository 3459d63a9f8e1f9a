#!/usr/bin/env python3
"""Per-block timing of the Hopper backward: for every block of the last bwd_kv_kernel launch,
the global timer at entry, when K/V arrived, after the last step and at the end, its SM and
its step count, summarised per phase (entry -> K/V, step loop, per step, epilogue, gap to the
SM's next block) for a causal window, full causal and dense (B=2, H=16, N=16384, D=128, bf16),
and random block masks at N=4096, B=4 (density 1/16 and 0, 128-blocks); pass case
names to run a subset (window1024 causal dense sparse16 sparse0).

Needs a library built with the probe, e.g. on a machine with nvcc:
  cmake -S . -B build-trace -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=90 -DBUILD_SHARED_LIBS=ON \
        -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CUDA_FLAGS=-DFA_SM90_TRACE" && cmake --build build-trace
then on the GPU: FLASHATTN_LIBRARY=build-trace/libflashattn.so PYTHONPATH=python \
  python3 tools/dev/gpu_trace.py   (CSV per case into $OUT or the current folder)"""
import ctypes, os, statistics as st, sys, torch
import flashattn
lib = ctypes.CDLL(os.environ["FLASHATTN_LIBRARY"])
H, D = 16, 128

def run(name, B=2, N=16384, **kw):
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        return
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        out = flashattn.flash_attn_func(q, k, v, **kw)
        torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    path = os.path.join(os.environ.get("OUT", "."), "trace-%s.csv" % name)
    assert lib.fa_sm90_trace_dump(path.encode()) == 0
    rows = [list(map(int, l.split(","))) for l in open(path).read().split("\n")[1:] if l]
    t_begin = min(r[1] for r in rows)
    pro = [r[2] - r[1] for r in rows]; loop = [r[3] - r[2] for r in rows]; epi = [r[4] - r[3] for r in rows]
    steps = [r[6] for r in rows]
    per_step = [l / s for l, s in zip(loop, steps) if s]
    bysm = {}
    for r in rows: bysm.setdefault(r[5], []).append(r)
    gaps = []
    for sm, rs in bysm.items():
        rs.sort(key=lambda r: r[1])
        gaps += [b[1] - a[4] for a, b in zip(rs, rs[1:])]
    span = max(r[4] for r in rows) - t_begin
    busy = sum(r[4] - r[1] for r in rows) / len(bysm)
    f = lambda xs: "median %.2f mean %.2f p90 %.2f us" % (
        st.median(xs) / 1e3, st.mean(xs) / 1e3, sorted(xs)[int(0.9 * len(xs))] / 1e3) if xs else "-"
    print("== %s: %d blocks on %d SMs, kernel span %.3f ms, per-SM busy %.3f ms, steps median %d"
          % (name, len(rows), len(bysm), span / 1e6, busy / 1e6, st.median(steps)))
    print("  entry -> K/V ready : " + f(pro))
    print("  step loop          : " + f(loop))
    print("  per step           : " + f(per_step))
    print("  loop -> end (dK/dV): " + f(epi))
    print("  gap to next block on the SM: " + f(gaps))
    first = sorted(rows, key=lambda r: r[1])[:132]
    print("  first wave: entry spread %.2f us, K/V ready median %.2f us after entry"
          % ((max(r[1] for r in first) - min(r[1] for r in first)) / 1e3,
             st.median(r[2] - r[1] for r in first) / 1e3))

def random_blocks(B, N, keep, bs=128):
    """every (batch, head, query block) keeps `keep` random key blocks, like --block-sparse"""
    nb = N // bs
    g = torch.Generator(device="cuda").manual_seed(1)
    idx = torch.rand(B, H, nb, nb, device="cuda", generator=g).argsort(-1)[..., :keep]
    m = torch.zeros(B, H, nb, nb, device="cuda", dtype=torch.uint8)
    return m.scatter_(-1, idx, 1)

run("window1024", causal=True, window_size=(1024, 0))
run("causal", causal=True)
run("dense", causal=False)
run("sparse16", B=4, N=4096, block_mask=random_blocks(4, 4096, 2), block_size=(128, 128))
run("sparse0", B=4, N=4096, block_mask=torch.zeros(4, H, 32, 32, device="cuda",
                                                     dtype=torch.uint8), block_size=(128, 128))
