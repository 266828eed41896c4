"""The GEMM algorithm sweep (TEC_GEMM_TUNE=1) on one GPU: sweeps the layer shapes of
docs/performance.md, checks every result against a float32 product, and prints the
engine's counters and each shape's time with the heuristic's answer and after the sweep.
    python3 scripts/gemm_sweep_check.py
"""
import ctypes
import os
import sys

os.environ["TEC_GEMM_TUNE"] = "1"  # read once, at the engine's first GEMM
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from transformer_engine_c import _engine  # noqa: E402

SHAPES = ["8192x6144x4096", "4096x6144x4096", "8192x3072x4096", "2048x3072x4096", "8192x4096x6144",
          "4096x4096x6144", "4096x4096x2048", "2048x8192x4096", "2048x6144x4096"]


def stats():
    out = (ctypes.c_longlong * 7)()
    ctypes.CDLL(_engine._CUDA_LIB).tec_cuda_gemm_stats(out)
    return list(out)


def ms_per_call(fn, n=20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main():
    for mnk in SHAPES:
        m, n, k = (int(v) for v in mnk.split("x"))
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        ref = a.float() @ b.float().t()
        before = stats()
        first = ms_per_call(lambda: _engine.gemm(a, b, transb=True), 1)  # sweeps, then the heuristic's product
        heur = ms_per_call(lambda: _engine.gemm(a, b, transb=True))  # read back at its first call
        tuned = ms_per_call(lambda: _engine.gemm(a, b, transb=True))
        y = _engine.gemm(a, b, transb=True)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        after = stats()
        print(f"{mnk:>16}  first call {first:7.3f} ms  next 20 {heur:6.3f} ms  then {tuned:6.3f} ms  "
              f"sweeps +{after[4] - before[4]} chosen +{after[5] - before[5]} "
              f"other than the heuristic's +{after[6] - before[6]}  rel err {err:.1e}")
        assert err < 2e-2, (mnk, err)
    print("counters [fused, epilogue kernels, simt, plans, sweeps, chosen, other]:", stats())


if __name__ == "__main__":
    main()
