#!/usr/bin/env python3
"""Train and generate with a Hugging Face transformers model using flashattn's attention,
beside transformers' own SDPA attention: loss, step time, peak memory, generation speed.

The model is built from a config (Llama- or GPT-2-shaped, no downloads) and trained on
the synthetic task of examples/gpt2_train.py (Markov text whose second half repeats the
first), in padded batches: a quarter of the sequences are cut short, and the tokenizer-
style attention_mask marks their padding, so flashattn takes its variable-length path.
Then both generate from a left-padded batch of prompts with a KV cache.

flashattn is turned on with one line:

    model.set_attn_implementation(flashattn.transformers.register())

    python examples/transformers_train.py                      # CPU: tiny, a few steps
    python examples/transformers_train.py --device cuda        # GPU: ~100M parameters, bf16
    python examples/transformers_train.py --model gpt2 --json out.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

try:
    import flashattn
except ImportError:  # a checkout without `pip install .`
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
    import flashattn
import flashattn.transformers
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_train import SyntheticData, peak_memory_mb, write_json  # noqa: E402


def build(args):
    if args.model == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, max_position_embeddings=2 * args.seqlen,
            attention_dropout=args.dropout, pad_token_id=0)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=2 * args.seqlen,
                                  n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                                  attn_pdrop=args.dropout, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def padded_batch(data, args, gen):
    """Token ids, attention_mask (1 = token) and labels (-100 on padding): a quarter of
    the rows end early, right-padded as a tokenizer pads training batches."""
    x, _ = data.batch(args.batch, args.seqlen, args.device)
    mask = torch.ones_like(x)
    for i in range(args.batch):
        if torch.rand((), generator=gen) < args.pad_fraction:
            n = int(torch.randint(args.seqlen // 4, args.seqlen, (), generator=gen))
            mask[i, n:] = 0
    x = x.masked_fill(mask == 0, 0)
    return x, mask, x.masked_fill(mask == 0, -100)


def run(args, impl):
    device = args.device
    torch.manual_seed(args.seed)
    model = build(args).to(device)
    model.set_attn_implementation(flashattn.transformers.register() if impl == "flashattn"
                                  else impl)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                            betas=(0.9, 0.95))
    data = SyntheticData(args.vocab, args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed + 2)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" \
        else torch.autocast("cpu", enabled=False)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rss0 = peak_memory_mb("cpu")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    losses, times = [], []
    for step in range(args.steps):
        x, mask, labels = padded_batch(data, args, gen)
        sync()
        t0 = time.perf_counter()
        with amp:
            loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if args.verbose and step % 10 == 0:
            print("  %-9s step %4d  loss %.4f  %.1f ms" % (impl, step, losses[-1], 1e3 * times[-1]),
                  flush=True)
    peak = peak_memory_mb(device, rss0 if device == "cpu" else 0.0)

    # generation: a left-padded batch of prompts, greedy, with the KV cache
    model.eval()
    prompts, _ = data.batch(args.gen_batch, args.prompt_len, device)
    pmask = torch.ones_like(prompts)
    for i in range(1, args.gen_batch, 2):  # every other prompt is shorter
        pmask[i, :args.prompt_len // 3] = 0
    prompts = prompts.masked_fill(pmask == 0, 0)
    with torch.no_grad(), amp:
        model.generate(input_ids=prompts, attention_mask=pmask, max_new_tokens=2,
                       do_sample=False, pad_token_id=0)  # warm-up
        sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=prompts, attention_mask=pmask,
                             max_new_tokens=args.gen_tokens, do_sample=False, pad_token_id=0)
        sync()
        gen_s = time.perf_counter() - t0
    steady = times[min(len(times) - 1, max(1, len(times) // 5)):]
    return {"impl": impl, "losses": losses, "step_ms": 1e3 * statistics.median(steady),
            "peak_mb": peak, "gen_tokens_per_s": args.gen_batch * args.gen_tokens / gen_s,
            "generated": out[:, args.prompt_len:].tolist()}


def run_child(impl):
    """On the CPU each run gets its own process, so that its peak RSS is its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", impl] + sys.argv[1:]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = res.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line)
    if res.returncode != 0 or not lines:
        sys.exit("%s run failed (exit status %d)" % (impl, res.returncode))
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--impl", default="flashattn,sdpa")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, help="Llama: K/V heads (grouped-query attention)")
    p.add_argument("--vocab", type=int)
    p.add_argument("--seqlen", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout in training")
    p.add_argument("--pad-fraction", type=float, default=0.25)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-batch", type=int, default=4)
    p.add_argument("--gen-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args()
    gpu = args.device == "cuda"
    defaults = dict(layers=12 if gpu else 2, hidden=768 if gpu else 64, heads=12 if gpu else 4,
                    kv_heads=4 if gpu else 2, vocab=32000 if gpu else 256,
                    seqlen=1024 if gpu else 64, batch=8 if gpu else 4, steps=100 if gpu else 12,
                    lr=6e-4 if gpu else 3e-3, gen_tokens=128 if gpu else 8)
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if args.model == "gpt2":
        args.kv_heads = args.heads
    if gpu and not torch.cuda.is_available():
        sys.exit("no CUDA device")
    if args._child:
        print(json.dumps(run(args, args._child)))
        return
    print("%s-shaped model: %d layers, hidden %d, %d heads (%d K/V), vocab %d; batch %d x %d "
          "tokens (%.0f%% of rows padded), %d steps on %s (flashattn %s, torch %s, "
          "transformers %s)" % (args.model, args.layers, args.hidden, args.heads, args.kv_heads,
                                args.vocab, args.batch, args.seqlen, 100 * args.pad_fraction,
                                args.steps, args.device, flashattn.version(), torch.__version__,
                                transformers.__version__))
    results = [run(args, impl) if gpu else run_child(impl) for impl in args.impl.split(",")]
    print("\n%-10s %11s %11s %10s %14s %12s" % ("attention", "first loss", "final loss",
                                              "step (ms)", "peak mem (MB)", "gen tok/s"))
    if not gpu:
        print("(CPU peak memory: growth of the process's peak RSS during training)")
    for r in results:
        tail = r["losses"][-max(1, len(r["losses"]) // 10):]
        print("%-10s %11.4f %11.4f %10.1f %14.0f %12.1f" % (
            r["impl"], r["losses"][0], sum(tail) / len(tail), r["step_ms"], r["peak_mb"],
            r["gen_tokens_per_s"]))
    by = {r["impl"]: r for r in results}
    if "flashattn" in by and "sdpa" in by:
        a, b = by["flashattn"], by["sdpa"]
        diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        same = sum(x == y for x, y in zip(a["generated"], b["generated"]))
        print("flashattn/sdpa: step time %.2fx, peak memory %.2fx, generation speed %.2fx; "
              "max per-step loss difference %.2e; %d of %d generated sequences identical"
              % (a["step_ms"] / b["step_ms"], a["peak_mb"] / max(b["peak_mb"], 1e-9),
                 a["gen_tokens_per_s"] / b["gen_tokens_per_s"], diff, same, len(a["generated"])))
    if args.json:
        write_json(args.json, args, results)


if __name__ == "__main__":
    main()
