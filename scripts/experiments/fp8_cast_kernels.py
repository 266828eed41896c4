"""GPU microseconds per FP8 cast kernel (CUDA events, 200 calls, median of
5 samples): the plain cast + transpose, with the bias gradient, with gelu
fused, and gelu's backward fused with the bias gradient, at three shapes.
To compare two builds, run it once per build (PYTHONPATH pointing at each
tree) in one session on one GPU.

    python3 scripts/experiments/fp8_cast_kernels.py
"""
import torch

from transformer_engine_c import _fp8_engine as F

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def median_us(fn, calls=200, samples=5):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        res.append(a.elapsed_time(b) / calls * 1000)
    return sorted(res)[samples // 2]


def main():
    dev = "cuda"
    for rows, cols in ((2048, 6144), (2048, 2048), (8192, 16384)):
        x = torch.randn(rows, cols, dtype=torch.bfloat16, device=dev)
        h = torch.randn(rows, cols, dtype=torch.bfloat16, device=dev)
        s, amax = torch.ones(1, device=dev), torch.zeros(1, device=dev)
        db = torch.empty(cols, dtype=torch.bfloat16, device=dev)
        cases = {
            "cast+t": lambda: F.quantize(x, E4, s, amax=amax, columnwise=True),
            "cast+t+dbias": lambda: F.quantize(x, E5, s, amax=amax, columnwise=True, dbias=db),
            "gelu+cast+t": lambda: F.quantize(x, E4, s, amax=amax, columnwise=True, activation="gelu"),
            "dgelu+cast+t+dbias": lambda: F.quantize(x, E5, s, amax=amax, columnwise=True, dbias=db,
                                                     activation="gelu", activation_input=h),
        }
        for name, fn in cases.items():
            print(f"{rows}x{cols} {name:22s} {median_us(fn):8.1f} us")


if __name__ == "__main__":
    main()
