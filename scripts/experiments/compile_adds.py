"""What torch.compile adds to a training step's host time, ours against
torch.nn's GPT-style block (benchmarks/blocks.py), in interleaved rounds.

    python scripts/experiments/compile_adds.py [--tokens 16 --hidden 32] [--rounds 15] [--steps 50]

Each round times --steps forward+backward steps of each of the four variants
(torch, torch compiled, ours, ours compiled), in an order that rotates from
round to round. On the CPU the time is the thread's CPU time (one intra-op
thread, so that the machine's other work does not count); on CUDA the host
clock with the device idle at the start. Printed: per variant the median
and the best round (µs per step), what compiling adds to each block
(compiled − eager, from the medians and from the best rounds) and
compiled / eager."""
import argparse
import statistics
import time

import torch

import transformer_engine_c as tec
from transformer_engine_c.benchmarks.blocks import OurBlock, TorchBlock, copy_into, geometry, step

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=16)
ap.add_argument("--hidden", type=int, default=32)
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--steps", type=int, default=50)
args = ap.parse_args()
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
dtype = torch.bfloat16 if cuda else torch.float32
if not cuda:
    torch.set_num_threads(1)
seq, batch, heads = geometry(args.tokens, args.hidden)
torch.manual_seed(0)
ours = OurBlock(tec, args.hidden, heads, dtype, device)
ref = TorchBlock(args.hidden, heads, dtype, device)
copy_into(ours, ref)
x = torch.randn(seq, batch, args.hidden, dtype=dtype, device=device, requires_grad=True)
dy = torch.randn_like(x)
fns = {"torch": step(ref, x, dy), "torch_compiled": step(torch.compile(ref), x, dy),
       "ours": step(ours, x, dy), "ours_compiled": step(torch.compile(ours, fullgraph=True), x, dy)}
clock = time.perf_counter if cuda else time.thread_time
for fn in fns.values():
    for _ in range(5):
        fn()
times = {n: [] for n in fns}
names = list(fns)
for r in range(args.rounds):
    for n in names[r % 4:] + names[:r % 4]:
        fn = fns[n]
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(args.steps):
            fn()
        times[n].append((clock() - t0) / args.steps * 1e6)
        if cuda:
            torch.cuda.synchronize()
med = {n: statistics.median(v) for n, v in times.items()}
best = {n: min(v) for n, v in times.items()}
for n in names:
    print(f"{n:16s} median {med[n]:8.1f} us  best {best[n]:8.1f} us")
for what, t in (("median", med), ("best", best)):
    o, p = t["ours_compiled"] - t["ours"], t["torch_compiled"] - t["torch"]
    print(f"{what}: compiling adds ours {o:.1f} us, torch {p:.1f} us; ours compiled/eager "
          f"{t['ours_compiled'] / t['ours']:.3f}, torch compiled/eager {t['torch_compiled'] / t['torch']:.3f}")
