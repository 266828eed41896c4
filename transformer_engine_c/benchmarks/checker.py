"""Overhead of tec.debug.check_saved_tensors on a multi-layer forward+backward.

    python -m transformer_engine_c.bench_checker [--device cpu|cuda] [--tokens 512] [--hidden 256]

Times a stack of LayerNormLinear -> GELU -> Linear blocks, forward + backward,
without the checker and with it in three settings (no communicator
registered; stand-in communicators with own + peer ranges; the same without
module tracking), rounds interleaved; the overhead is taken between best
steps (steadier than medians on a shared machine). The checker is entered
once per step (its setup is included). Then the pack hook alone, per saved
tensor. Prints a markdown table for docs/performance.md.
"""
import argparse
import statistics
import time

import torch

import transformer_engine_c as tec
from transformer_engine_c import debug


class _StandIn:
    """A communicator stand-in: `peers` buffers of `nbytes` each (own + peers)."""

    def __init__(self, name, peers, nbytes, device):
        self.name = name
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(peers)]

    def buffer_ranges(self):
        return [(b.data_ptr(), b.numel()) for b in self.bufs]


def _model(layers, hidden, dtype, device):
    blocks = []
    for _ in range(layers):
        blocks += [tec.LayerNormLinear(hidden, 4 * hidden, params_dtype=dtype, device=device), torch.nn.GELU(),
                   tec.Linear(4 * hidden, hidden, params_dtype=dtype, device=device)]
    return torch.nn.Sequential(*blocks)


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(device="cpu", tokens=512, hidden=256, layers=4, dtype=torch.float32, iters=30, warmup=5,
        comms=2, peers=4):
    model = _model(layers, hidden, dtype, device)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    stand_ins = [_StandIn(f"ub{i}", peers, tokens * hidden * 4, device) for i in range(comms)]

    def step():
        model(x).sum().backward()

    modes = {
        "no checker": lambda: None,
        "checker, no communicator": lambda: debug.check_saved_tensors([]),
        f"checker, {comms}x{peers} ranges": lambda: debug.check_saved_tensors(stand_ins, model=model),
        f"checker, {comms}x{peers} ranges, no module tracking":
            lambda: debug.check_saved_tensors(stand_ins, track_modules=False),
    }
    times = {k: [] for k in modes}
    saved = 0
    for r in range(warmup + iters):
        for name, make in modes.items():
            cm = make()
            _sync(device)
            t0 = time.perf_counter()
            if cm is None:
                step()
            else:
                with cm as chk:
                    step()
                saved = chk.checked
                assert not chk.violations
            _sync(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    base = min(times["no checker"])
    rows = []
    for name, ts in times.items():
        best = min(ts)
        rows.append((name, statistics.median(ts) * 1e3, best * 1e3, (best - base) * 1e3, (best / base - 1) * 100,
                     (best - base) / saved * 1e6))
    return rows, saved


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for PyTorch (1: steadier numbers on a shared machine)")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    rows, saved = run(a.device, a.tokens, a.hidden, a.layers, getattr(torch, a.dtype), a.iters)
    print(f"device={a.device} tokens={a.tokens} hidden={a.hidden} layers={a.layers} dtype={a.dtype} "
          f"threads={torch.get_num_threads()} saved tensors/step={saved}")
    print("| setting | median step (ms) | best step (ms) | overhead, best (ms) | overhead (%) | per saved tensor (us) |")
    print("|---|---|---|---|---|---|")
    for name, med, best, d, pct, per in rows:
        print(f"| {name} | {med:.3f} | {best:.3f} | {d:+.3f} | {pct:+.1f} | {per:+.1f} |")
    print()
    print("Per saved tensor, one small op saving one tensor, 20000 times:")
    for name, us in micro(a.device).items():
        print(f"  {name}: {us:.2f} us per saved tensor")


def micro(device="cpu", n=20000, rounds=5):
    """Cost of the pack hook alone: `a * w` saves `a` (w requires grad)."""
    a = torch.randn(16, device=device)
    w = torch.randn(16, device=device, requires_grad=True)
    stand_ins = [_StandIn(f"ub{i}", 4, 1 << 20, device) for i in range(2)]

    def loop():
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            a * w
        _sync(device)
        return time.perf_counter() - t0

    settings = {"no checker": None, "a no-op saved_tensors_hooks pair (reference)": "noop",
                "checker, no communicator": [], "checker, 2x4 ranges": stand_ins}
    best = {k: float("inf") for k in settings}
    for _ in range(rounds):
        for k, comms in settings.items():
            if comms is None:
                best[k] = min(best[k], loop())
            elif comms == "noop":
                with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
                    best[k] = min(best[k], loop())
            else:
                with debug.check_saved_tensors(comms):
                    best[k] = min(best[k], loop())
    base = best["no checker"]
    return {"op without checker": base / n * 1e6,
            **{f"added by {k}": (t - base) / n * 1e6 for k, t in best.items() if k != "no checker"}}


if __name__ == "__main__":
    main()
