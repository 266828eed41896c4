"""Where an FP8 layer step's time goes: host (cProfile, top functions by
own time) and device (torch.profiler's kernel table), for one block and
shape, DelayedScaling, against the same bf16 step.

    python3 scripts/experiments/fp8_step_profile.py [--block LayerNormLinear] [--shape 2048x2048x6144]
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

import transformer_engine_c as te
from transformer_engine_c.recipe import DelayedScaling


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="LayerNormLinear")
    ap.add_argument("--shape", default="2048x2048x6144")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    t, h, n = (int(v) for v in a.shape.split("x"))
    dev = "cuda"
    cls = getattr(te, a.block)
    layer = cls(h, n, params_dtype=torch.bfloat16, device=dev)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, h if a.block == "LayerNormMLP" else n, device=dev, dtype=torch.bfloat16)
    recipe = DelayedScaling()

    def step(fp8):
        with te.autocast(enabled=fp8, recipe=recipe):
            y = layer(x)
        y.backward(dy)

    for fp8 in (False, True):
        for _ in range(5):
            step(fp8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(fp8)
        host = (time.perf_counter() - t0) / a.steps * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / a.steps * 1e3
        print(f"{'fp8' if fp8 else 'bf16'}: host {host:.3f} ms/step, wall {wall:.3f} ms/step")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        step(True)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step(True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
