"""Benchmark: context-parallel attention (DotProductAttention with a
cp_group) against the same attention over the whole sequence on one rank.

    python -m transformer_engine_c.bench --cp                          # 2 GPUs, or 2 CPU ranks
    python -m transformer_engine_c.bench --cp --tokens 8192,16384,32768 --comm-types p2p,a2a
    python -m transformer_engine_c.bench --cp --device cpu --tokens 1024 --iters 2

Each row is causal self-attention of one sequence of TOKENS tokens (batch 1,
--heads heads of --head-dim, sbhd), forward + backward:
  * one_rank: DotProductAttention over the whole sequence, on every rank at
    once (each rank its own GPU, or its own CPU core);
  * cp: DotProductAttention with the cp group over each rank's TOKENS / cp
    tokens (chunks r and 2cp-1-r), the time of the slowest rank;
  * speedup = one_rank / cp;
  * for p2p also cp_serial (each exchange waited for as soon as it is
    issued, the attention of the step after it), exchange (the ring's
    messages alone: the forward's and the backward's key/value shards and
    the backward's gradient sums) and overlap = (cp_serial - cp) / exchange,
    the share of the exchange time hidden behind attention (0: none, 1: all).
Times are medians over --iters samples after --warmup (the host clock after
a device synchronisation and a barrier), the maximum over ranks. Results: a
table on stdout, cp.json and cp.md in --out."""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .._launch import init_rank, relaunch, under_torchrun

COMM_TYPES = ("p2p", "all_gather", "a2a")


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c.bench --cp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpus >= 2 else "cpu")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the context-parallel group")
    ap.add_argument("--tokens", default=None, help="comma-separated sequence lengths (GPU default "
                    "8192,16384,32768; CPU 8192)")
    ap.add_argument("--comm-types", default=",".join(COMM_TYPES), help=f"comma-separated, of {COMM_TYPES}")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (GPU default 16, CPU 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="head size (GPU default 128, CPU 64)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="GPU default bfloat16, CPU float32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=None, help="samples per variant (GPU default 10, CPU 3)")
    ap.add_argument("--out", default=None, help="directory for cp.json / cp.md")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.tokens = [int(t) for t in (args.tokens or ("8192,16384,32768" if cuda else "8192")).split(",")]
    args.comm_types = args.comm_types.split(",")
    for kind in args.comm_types:
        if kind not in COMM_TYPES:
            ap.error(f"--comm-types: {kind!r} is not one of {COMM_TYPES}")
    args.heads = args.heads or (16 if cuda else 2)
    args.head_dim = args.head_dim or (128 if cuda else 64)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.iters = args.iters or (10 if cuda else 3)
    for t in args.tokens:
        if t % (2 * args.nproc):
            ap.error(f"--tokens: {t} does not split into 2 x {args.nproc} chunks")
    return args


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_max(fn, dev, warmup, iters):
    """Median over samples of fn's time, each sample the slowest rank's."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        samples.append(dt.item())
    return statistics.median(samples) * 1e3


def _fwd_bwd(mod, q, k, v, dout):
    def run():
        for t in (q, k, v):
            t.grad = None
        mod(q, k, v).backward(dout)
    return run


def _exchanges(cfg, k, v):
    """The p2p ring's messages alone, as one fwd+bwd sends them."""
    from ..attention import context_parallel as cp
    kv = cp._pack(k, v)
    dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=kv.device)
    n = cfg.p2p_size

    def run():
        buf = kv
        for step in range(n - 1):  # forward
            buf = cp._Exchange(cfg, buf, torch.empty_like(buf), "bench key/value", step, tag=0).wait()
        buf = kv
        acc = dkv
        for step in range(n):  # backward: key/value shards and gradient sums
            ex = cp._Exchange(cfg, buf, torch.empty_like(buf), "bench key/value", step, tag=1) if step + 1 < n \
                else None
            acc = cp._Exchange(cfg, acc, torch.empty_like(acc), "bench gradient", step, tag=2).wait()
            if ex is not None:
                buf = ex.wait()
    return run


def worker(args):
    from .. import DotProductAttention
    from ..attention import context_parallel as cp
    rank, world, dev = init_rank(args.device)
    group = dist.new_group(list(range(world)))
    if args.device == "cuda":
        cp_stream = torch.cuda.Stream()
    else:
        cp_stream = None
        torch.set_num_threads(1)
    h, d, dtype = args.heads, args.head_dim, args.dtype
    rows = []
    for tokens in args.tokens:
        g = torch.Generator().manual_seed(tokens)
        q, k, v, dout = (torch.randn(tokens, 1, h, d, generator=g).to(dev, dtype) for _ in range(4))
        whole = DotProductAttention(h, d, qkv_format="sbhd", attn_mask_type="causal")
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        one = _median_max(_fwd_bwd(whole, qf, kf, vf, dout.reshape(tokens, 1, h * d)), dev, args.warmup, args.iters)
        del qf, kf, vf
        ql, kl, vl, dl = (cp.shard_sequence(t, 0, world, rank).contiguous() for t in (q, k, v, dout))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        dl = dl.reshape(dl.shape[0], 1, h * d)
        for kind in args.comm_types:
            if kind == "a2a" and h % world:
                print(f"skipping a2a at {tokens} tokens: {h} heads do not divide by {world}", flush=True)
                continue
            mod = DotProductAttention(h, d, qkv_format="sbhd", attn_mask_type="causal", cp_group=group,
                                      cp_global_ranks=list(range(world)), cp_stream=cp_stream, cp_comm_type=kind)
            row = {"tokens": tokens, "comm_type": kind, "cp": world, "one_rank_ms": one}
            row["cp_ms"] = _median_max(_fwd_bwd(mod, ql, kl, vl, dl), dev, args.warmup, args.iters)
            row["speedup"] = one / row["cp_ms"]
            if kind == "p2p":
                cp.overlap_exchanges = False
                try:
                    row["cp_serial_ms"] = _median_max(_fwd_bwd(mod, ql, kl, vl, dl), dev, args.warmup, args.iters)
                finally:
                    cp.overlap_exchanges = True
                row["exchange_ms"] = _median_max(_exchanges(mod._cp, kl.detach(), vl.detach()), dev, args.warmup,
                                                 args.iters)
                row["overlap"] = (row["cp_serial_ms"] - row["cp_ms"]) / max(row["exchange_ms"], 1e-9)
            rows.append(row)
            if rank == 0:
                print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    if rank == 0:
        _report(args, rows, dev, world)
    dist.destroy_process_group()
    return 0


def _report(args, rows, dev, world):
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    head = (f"context-parallel attention, causal, fwd+bwd, CP={world} on {name}, heads {args.heads} x "
            f"{args.head_dim}, {str(args.dtype).replace('torch.', '')}")
    cols = ["tokens", "comm_type", "one_rank_ms", "cp_ms", "speedup", "cp_serial_ms", "exchange_ms", "overlap"]
    lines = [f"# {head}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                                       for c in cols) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cp.json"), "w") as f:
            json.dump({"meta": {"device": name, "cp": world, "heads": args.heads, "head_dim": args.head_dim,
                                "dtype": str(args.dtype), "iters": args.iters}, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "cp.md"), "w") as f:
            f.write(text + "\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if not under_torchrun():
        return relaunch("transformer_engine_c.bench", args.nproc, ["--cp", *argv])
    return worker(args)
