"""The FP8 cast kernels' speed on one CUDA GPU: quantize with its
transpose (cast+transpose), with the fused bias gradient, and rowwise only,
as GB/s of bytes moved (input read, codes written), against the same result
from PyTorch ops in the same process ((x * s).to(fp8), its transpose made
contiguous, dY's column sums). Also checks that the two agree byte for byte.

    python3 scripts/fp8_cast_bench.py [--shapes 8192x4096,4096x12288,8192x12288]
"""
import argparse

import torch

from transformer_engine_c import _fp8_engine as F
from fp8_gemm_bench import timed  # one CUDA-event timer for the FP8 benchmarks in scripts/

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x4096,4096x12288,12288x4096,8192x12288,2048x2048,2048x6144")
    a = ap.parse_args()
    print(f"{'shape':>12} {'what':>20} {'ours ms':>8} {'GB/s':>7} {'torch ms':>9} {'GB/s':>7} {'x':>6}")
    for spec in a.shapes.split(","):
        rows, cols = (int(v) for v in spec.split("x"))
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        s = torch.tensor([8.0], device="cuda")
        n = rows * cols
        db = torch.empty(cols, device="cuda", dtype=torch.bfloat16)

        def torch_ct(fp8):
            q = (x.float() * s).to(fp8)
            return q, q.t().contiguous()

        cases = [
            ("cast+transpose", 2 * n + 2 * n, lambda: F.quantize(x, E4M3, s, columnwise=True),
             lambda: torch_ct(E4M3)),
            ("cast+transpose+dbias", 2 * n + 2 * n, lambda: F.quantize(x, E5M2, s, columnwise=True, dbias=db),
             lambda: (torch_ct(E5M2), x.sum(0, dtype=torch.float32).to(x.dtype))),
            ("cast", 2 * n + n, lambda: F.quantize(x, E4M3, s), lambda: (x.float() * s).to(E4M3)),
        ]
        d, dt, _ = F.quantize(x, E4M3, s, columnwise=True)
        q, qt = torch_ct(E4M3)
        same = torch.equal(d, q.view(torch.uint8)) and torch.equal(dt, qt.view(torch.uint8))
        for what, nbytes, ours, ref in cases:
            t_o, t_r = timed(ours), timed(ref)
            print(f"{spec:>12} {what:>20} {t_o:8.4f} {nbytes / t_o / 1e6:7.0f} {t_r:9.4f} {nbytes / t_r / 1e6:7.0f} "
                  f"{t_r / t_o:6.2f}")
        print(f"{spec:>12} {'bytes equal torch':>20} {same}")


if __name__ == "__main__":
    main()
