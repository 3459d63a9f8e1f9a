#!/usr/bin/env python3
"""Train a GPT-2-shaped model with flashattn's attention and with torch's math SDPA,
side by side: loss curve, step time and peak memory.

Plain torch, no downloads: the model is GPT-2 (pre-LayerNorm blocks, GELU MLP, tied
embeddings) built here, trained on a synthetic task that can be learnt (each sequence
is a random prefix repeated, so the second copy is predictable: induction heads).

    python examples/gpt2_train.py                      # CPU: a tiny config, a few steps
    python examples/gpt2_train.py --device cuda        # GPU: GPT-2 small at 1024 and 4096

On CUDA it needs the CUDA backward of flashattn; while that is missing the flashattn
rows report the library's FA_ERR_UNSUPPORTED and the math rows still run.
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import flashattn
except ImportError:  # running from a checkout without `pip install .`
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
    import flashattn


# ---- the model ------------------------------------------------------------------------


def math_attention(qkv):
    """torch SDPA restricted to its math backend: S and P materialised."""
    q, k, v = qkv.unbind(2)  # (B, N, H, D) each
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except ImportError:  # older torch: the same math by hand
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
        out = s.softmax(-1) @ v
    return out.transpose(1, 2)


def flash_attention(qkv):
    return flashattn.flash_attn_qkvpacked_func(qkv, causal=True)


def sdpa_flash_attention(qkv):
    """torch SDPA's flash backend (FlashAttention-2): a third bf16 run, the yardstick of how
    far two correct low-precision attentions drift apart over training."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2)


ATTENTION = {"flashattn": flash_attention, "math": math_attention, "sdpa-flash": sdpa_flash_attention}


class Block(nn.Module):
    def __init__(self, n_embd, n_head, attention):
        super().__init__()
        self.n_head = n_head
        self.attention = attention
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.n_head, c // self.n_head)
        x = x + self.proj(self.attention(qkv).reshape(b, n, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, n_ctx, n_layer, n_head, n_embd, attention):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(n_ctx, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.apply(self._init)
        for blk in self.blocks:  # GPT-2's scaled init of residual projections
            for p in (blk.proj.weight, blk.fc_proj.weight):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied embeddings
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class SyntheticData:
    """Learnable random text: a Markov chain in which each token has 4 possible
    successors (a bigram model gets the loss from ln(vocab) down to ln 4), and every
    sequence is a prefix repeated once, so attention can copy the second half (the
    loss goes on down once induction heads form)."""

    def __init__(self, vocab, seed):
        self.gen = np.random.default_rng(seed)
        self.next = self.gen.integers(0, vocab, size=(vocab, 4))
        self.vocab = vocab

    def batch(self, batch, seqlen, device):
        half = (seqlen + 2) // 2
        seq = np.empty((batch, half), dtype=np.int64)
        seq[:, 0] = self.gen.integers(0, self.vocab, size=batch)
        choice = self.gen.integers(0, 4, size=(batch, half))
        for t in range(1, half):
            seq[:, t] = self.next[seq[:, t - 1], choice[:, t]]
        seq = torch.from_numpy(np.concatenate([seq, seq], 1)[:, :seqlen + 1]).to(device)
        return seq[:, :-1], seq[:, 1:]


# ---- one run ----------------------------------------------------------------------------

OOM = (torch.cuda.OutOfMemoryError,) if hasattr(torch.cuda, "OutOfMemoryError") else ()


def peak_memory_mb(device, since=0.0):
    """CUDA: peak allocated by torch; CPU: growth of the process's peak RSS since `since`."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - since  # KiB on Linux


def run(args, impl, seqlen):
    device = args.device
    batch = args.batch or max(1, 8192 // seqlen)
    rss0 = peak_memory_mb("cpu")
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, seqlen, args.n_layer, args.n_head, args.n_embd,
                ATTENTION[impl]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                            betas=(0.9, 0.95))
    data = SyntheticData(args.vocab, args.seed + 1)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" \
        else torch.autocast("cpu", enabled=False)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in range(args.steps):
        x, y = data.batch(batch, seqlen, device)
        lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup))
        for g in opt.param_groups:
            g["lr"] = lr
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with amp:
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if args.verbose and (step % args.log_every == 0 or step == args.steps - 1):
            print("  %-9s N=%-5d step %4d  loss %.4f  %.1f ms" % (impl, seqlen, step, losses[-1],
                                                                   1e3 * times[-1]), flush=True)
    steady = times[min(len(times) - 1, max(1, len(times) // 5)):]
    return {"impl": impl, "seqlen": seqlen, "batch": batch, "losses": losses,
            "step_ms": 1e3 * statistics.median(steady), "peak_mb": peak_memory_mb(device, rss0 if device == "cpu" else 0.0)}


def run_child(args, impl, seqlen):
    """On the CPU each run gets its own process, so peak RSS is its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", impl, str(seqlen)]
    cmd += [a for a in sys.argv[1:] if a != "--verbose"] + (["--verbose"] if args.verbose else [])
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = res.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line)
    if res.returncode != 0 or not lines:
        return {"impl": impl, "seqlen": seqlen, "error": "exit status %d" % res.returncode}
    return json.loads(lines[-1])


def safe_run(args, impl, seqlen):
    try:
        return run(args, impl, seqlen)
    except flashattn.FlashAttnError as e:
        return {"impl": impl, "seqlen": seqlen, "error": str(e)}
    except OOM as e:
        return {"impl": impl, "seqlen": seqlen, "error": "out of memory: %s" % str(e)[:80]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seqlen", default=None, help="comma-separated (GPU default 1024,4096)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per step (default: 8192 tokens per step on GPU, 4 on CPU)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default="flashattn,math")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json", help="write the results (loss curves included) here")
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    gpu = args.device == "cuda"
    # GPU: GPT-2 small (124M); CPU: something that trains in seconds
    defaults = dict(n_layer=12 if gpu else 2, n_head=12 if gpu else 4, n_embd=768 if gpu else 128,
                    vocab=50257 if gpu else 256, seqlen="1024,4096" if gpu else "128,512",
                    batch=0 if gpu else 4, steps=300 if gpu else 40, lr=6e-4 if gpu else 3e-3)
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if gpu and not torch.cuda.is_available():
        sys.exit("no CUDA device")
    if args._child:
        print(json.dumps(run(args, args._child[0], int(args._child[1]))))
        return

    seqlens = [int(s) for s in args.seqlen.split(",")]
    impls = args.impl.split(",")
    print("GPT-2 config: n_layer=%d n_head=%d n_embd=%d vocab=%d batch=%s steps=%d on %s "
          "(flashattn %s, torch %s)" % (args.n_layer, args.n_head, args.n_embd, args.vocab,
                                        args.batch or "8192 tokens", args.steps, args.device,
                                        flashattn.version(), torch.__version__))
    results = []
    for n in seqlens:
        for impl in impls:
            r = safe_run(args, impl, n) if gpu else run_child(args, impl, n)
            results.append(r)

    print("\n%-10s %6s %12s %12s %12s %14s" % ("attention", "seqlen", "first loss",
                                              "final loss", "step (ms)", "peak mem (MB)"))
    if not gpu:
        print("(CPU peak memory: growth of the process's peak RSS during training)")
    for r in results:
        if "error" in r:
            print("%-10s %6d  error: %s" % (r["impl"], r["seqlen"], r["error"]))
            continue
        tail = r["losses"][-max(1, len(r["losses"]) // 10):]
        print("%-10s %6d %12.4f %12.4f %12.1f %14.0f" % (r["impl"], r["seqlen"], r["losses"][0],
                                                        sum(tail) / len(tail), r["step_ms"],
                                                        r["peak_mb"]))
    by = {(r["impl"], r["seqlen"]): r for r in results if "error" not in r}
    def tail_mean(r):  # per-step losses are noisy: compare the last tenth's means
        t = r["losses"][-max(1, len(r["losses"]) // 10):]
        return sum(t) / len(t)

    for n in seqlens:
        b = by.get(("math", n))
        for name in ("flashattn", "sdpa-flash"):
            a = by.get((name, n))
            if a and b:
                diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
                print("seqlen %d: %s/math step time %.2fx, peak memory %.2fx, final loss %+.4f, "
                      "max per-step loss difference %.2e" % (
                          n, name, a["step_ms"] / b["step_ms"], a["peak_mb"] / b["peak_mb"],
                          tail_mean(a) - tail_mean(b), diff))
    if args.json:
        write_json(args.json, args, results)


def write_json(path, args, results):
    """The run's arguments (less the internal ones) and results."""
    with open(path, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
