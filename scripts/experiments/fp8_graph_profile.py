"""Where a graphed LayerNormMLP step's time goes, bf16 against FP8
(DelayedScaling, Float8CurrentScaling; each also with the activation
computed apart from the casts, as before they were fused): the benchmark's
graphs row (`bench --fp8 --graphs`) taken apart. For each variant: wall and host ms per
step over --steps steps back to back, then torch.profiler's kernels per
step, grouped (GEMMs, casts, norm, activation, scale updates, the rest) and
listed; then the host's functions by own time (cProfile, 50 steps).

    python3 scripts/experiments/fp8_graph_profile.py [--shape 2048x2048x6144] [--steps 100]
"""
import argparse
import collections
import cProfile
import io
import pstats
import time

import torch

import transformer_engine_c as te
from transformer_engine_c import recipe as recipe_mod
from transformer_engine_c.benchmarks import fp8 as bench_fp8, tp1
from transformer_engine_c.module import _fp8

GROUPS = (("gemm", ("gemm", "sm90", "cutlass", "xmma", "nvjet")), ("cast", ("cast", "quantize", "transpose")),
          ("norm", ("norm",)), ("act", ("gelu", "act", "swiglu", "relu")), ("scale", ("amax", "scale", "delayed",
                                                                                       "history")))


def group(name):
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x2048x6144")
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    T, H, N = (int(v) for v in a.shape.split("x"))
    dev, dt = torch.device("cuda"), torch.bfloat16
    ours = tp1.ours_layer(te, "LayerNormMLP", H, N, dt, dev)
    x = torch.randn(T, H, dtype=dt, device=dev, requires_grad=True)
    dy = torch.randn(T, H, dtype=dt, device=dev)
    variants = [("bf16", None, True)]
    for rname, recipe in (("delayed", recipe_mod.DelayedScaling()), ("current", recipe_mod.Float8CurrentScaling())):
        variants += [(rname, recipe, True), (rname + ", activation not fused with the casts", recipe, False)]
    fuses = _fp8.FP8Call.fuses_activation
    for name, recipe, fused in variants:
        layer = ours if recipe is None else bench_fp8.fp8_twin(te, "LayerNormMLP", H, N, dt, dev, ours)
        _fp8.FP8Call.fuses_activation = fuses if fused else (lambda self, act: False)
        g = te.make_graphed_callables(layer, (x,), fp8_enabled=recipe is not None, fp8_recipe=recipe)
        _fp8.FP8Call.fuses_activation = fuses
        step = tp1.steps(g, x, dy)["fwd+bwd"] if recipe is None else bench_fp8.fp8_step(te, g, x, dy, recipe)
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        host = (time.perf_counter() - t0) / a.steps
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / a.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        per = collections.Counter()
        count = collections.Counter()
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if us and e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.key] += us / 20
                count[e.key] += e.count / 20
        groups = collections.Counter()
        for k, us in per.items():
            groups[group(k)] += us
        print(f"== {name}: wall {wall * 1e3:.3f} ms/step, host {host * 1e3:.3f} ms/step, "
              f"kernels {sum(per.values()) / 1e3:.3f} ms/step")
        print("   " + ", ".join(f"{g} {us / 1e3:.3f}" for g, us in groups.most_common()))
        for k, us in per.most_common(30):
            print(f"   {us:8.1f} us  x{count[k]:4.1f}  [{group(k)}] {k[:110]}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        print("   host, 50 steps, by own time:")
        print("\n".join("   " + line for line in text.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
