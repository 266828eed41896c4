"""Where the GPU time of one rank's MLP step goes, ours against plain
PyTorch, on one GPU without collectives: the per-rank work of the
benchmark's TP=2 MLP step (tokens gathered, ffn / 2 columns), so the GEMM,
norm and activation kernels of both are timed alone.

Variants: PyTorch (LayerNorm -> Linear -> gelu(tanh) -> Linear), ours as two
layers (LayerNormLinear -> gelu(tanh) -> Linear) and tec.LayerNormMLP (gelu).
For each: the profiler's per-kernel GPU time over eager steps, summed per
kernel name (the sum is the step's GPU work; the host time is not in it).

    python scripts/experiments/mlp_kernels.py [--shapes 2048x2048x6144,1024x1024x4096] [--tp 2]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import transformer_engine_c as tec  # noqa: E402


class TorchMLP(torch.nn.Module):
    def __init__(self, h, f, dtype):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h, dtype=dtype, device="cuda")
        self.fc1 = torch.nn.Linear(h, f, dtype=dtype, device="cuda")
        self.fc2 = torch.nn.Linear(f, h, dtype=dtype, device="cuda")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class OursTwo(torch.nn.Module):
    def __init__(self, h, f, dtype):
        super().__init__()
        self.fc1 = tec.LayerNormLinear(h, f, params_dtype=dtype, device="cuda")
        self.fc2 = tec.Linear(f, h, params_dtype=dtype, device="cuda")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def kernels(model, x, dy, steps=10):
    for _ in range(3):
        model(x).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(x).backward(dy)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            rows.append((ev.device_time_total / steps, ev.count // steps, ev.key[:70]))
    return sorted(rows, reverse=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x2048x6144,1024x1024x4096")
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    dtype = torch.bfloat16
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        t, h, n = (int(v) for v in shape.split("x"))
        f = n // args.tp
        x = torch.randn(t, h, dtype=dtype, device="cuda", requires_grad=True)
        dy = torch.randn(t, h, dtype=dtype, device="cuda")
        models = {"torch": TorchMLP(h, f, dtype), "ours two-layer": OursTwo(h, f, dtype),
                  "ours LayerNormMLP": tec.LayerNormMLP(h, f, activation="gelu", params_dtype=dtype, device="cuda")}
        print(f"== {shape} at TP={args.tp}: one rank's step, [{t}, {h}] -> {f} -> {h}, bf16")
        for name, m in models.items():
            rows = kernels(m, x, dy)
            total = sum(r[0] for r in rows)
            print(f"  -- {name}: kernels {total:8.1f} us per step")
            for us, count, key in rows[:12]:
                print(f"     {us:8.1f} us  x{count}  {key}")


if __name__ == "__main__":
    main()
