"""Host time per step of the GPT-style block (benchmarks/compile.py), eager
against compiled, and where the compiled step's host time goes (cProfile).

    python scripts/experiments/compile_host.py [--tokens 1024 --hidden 1024] [--profile N]
"""
import argparse
import cProfile
import pstats
import time

import torch

import transformer_engine_c as tec
from transformer_engine_c.benchmarks.blocks import OurBlock, geometry

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=1024)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--profile", type=int, default=30, help="the top N entries of each profile")
args = ap.parse_args()
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
dtype = torch.bfloat16 if cuda else torch.float32
seq, batch, heads = geometry(args.tokens, args.hidden)
torch.manual_seed(0)
ours = OurBlock(tec, args.hidden, heads, dtype, device)
compiled = torch.compile(ours, fullgraph=True)
x = torch.randn(seq, batch, args.hidden, dtype=dtype, device=device, requires_grad=True)
dy = torch.randn_like(x)


def steps(m, n):
    for _ in range(n):
        m(x).backward(dy)


def host_us(m, n):
    """Host time per step with the GPU idle at the start (the host issues
    ahead of the GPU: a step's launches, not its kernels)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps(m, n)
    t = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    return t / n * 1e6


for m in (ours, compiled):
    steps(m, 5)
for r in range(3):
    print(f"round {r}: eager {host_us(ours, 5):.0f} us, compiled {host_us(compiled, 5):.0f} us (host, 5 steps)")
for name, m in (("eager", ours), ("compiled", compiled)):
    prof = cProfile.Profile()
    prof.enable()
    steps(m, args.steps)
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    print(f"--- {name}: {args.steps} steps, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
