"""The GEMM algorithm sweep (TEC_GEMM_TUNE=1) on one GPU, over the layer shapes of
docs/performance-log.md: every result checked against a float32 product, the engine's
counters, and each shape's time with the heuristic's answer and with the sweep's
choice. The setting is read once per process, so each runs in its own process:
heuristic, sweep, heuristic again (the two heuristic runs show the drift between
processes).
    python3 scripts/gemm_sweep_check.py
"""
import ctypes
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ["8192x6144x4096", "4096x6144x4096", "8192x3072x4096", "2048x3072x4096", "8192x4096x6144",
          "4096x4096x6144", "4096x4096x2048", "2048x8192x4096", "2048x6144x4096"]


def child():
    """Time every shape in this process (TEC_GEMM_TUNE as set); print JSON."""
    sys.path.insert(0, ROOT)
    import torch

    from transformer_engine_c import _engine

    def stats():
        out = (ctypes.c_longlong * 8)()
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

    res = {}
    for mnk in SHAPES:
        m, n, k = (int(v) for v in mnk.split("x"))
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        ref = a.float() @ b.float().t()
        call = lambda: _engine.gemm(a, b, transb=True)  # noqa: E731
        for _ in range(3):  # the sweep (when on), its read-back, warm-up
            call()
            torch.cuda.synchronize()
        t = sorted(ms_per_call(call) for _ in range(5))[2]
        err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (mnk, err)
        res[mnk] = t
    print(json.dumps({"ms": res, "stats": stats()}))


def run(tune):
    env = dict(os.environ, TEC_GEMM_TUNE=tune)
    r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        sys.exit(f"TEC_GEMM_TUNE={tune} child failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    h1, tuned, h2 = run("0"), run("1"), run("0")
    print(f"{'shape':>16} {'heuristic':>10} {'sweep':>8} {'heuristic':>10}   (ms per call, median of 5 x 20)")
    for mnk in SHAPES:
        print(f"{mnk:>16} {h1['ms'][mnk]:10.4f} {tuned['ms'][mnk]:8.4f} {h2['ms'][mnk]:10.4f}")
    s = tuned["stats"]
    print(f"with the sweep: {s[4]} sweeps, {s[5]} read back, {s[6]} chose other than the heuristic's answer")
    assert h1["stats"][4] == 0 and s[4] >= len(SHAPES) and s[5] == s[4], (h1["stats"], s)


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
