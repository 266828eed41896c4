"""The host's Python work per eager training step on the CPU, bf16 against
FP8, with the engine's computing calls replaced by no-ops (the CPU engine
computes in them: what is left is what a GPU host also runs, less the
launches), in µs per step (the least of 7 samples):

    python3 scripts/experiments/fp8_host_stubbed.py [--general]

--general also times DelayedScaling with the one-call FP8 steps off
(module/_fp8_gemm.ONE_CALL). [16, 64] inputs; Linear 64->64, LayerNormLinear
64->64, LayerNormMLP 64->128->64, bf16 parameters."""
import argparse
import time

import torch

import transformer_engine_c as te
from transformer_engine_c import _C
from transformer_engine_c.module import _fp8_gemm
from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling

# the engine calls that compute (the workspace-size queries stay)
COMPUTING = ("gemm", "linear_bwd", "norm_fwd", "norm_bwd", "norm_linear_fwd", "norm_linear_bwd", "act_fwd", "act_bwd",
             "fp8_quantize", "fp8_gemm", "fp8_amax", "fp8_scale_from_amax", "fp8_delayed_update", "fp8_delayed_updates",
             "fp8_linear_fwd", "fp8_linear_bwd")


def timed(fn, n=300, samples=7):
    for _ in range(30):
        fn()
    best = float("inf")
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def layer(kind):
    torch.manual_seed(0)
    if kind == "Linear":
        return te.Linear(64, 64, params_dtype=torch.bfloat16)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16)
    return te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--general", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    real = {name: getattr(_C, name) for name in COMPUTING}
    for kind in ("Linear", "LayerNormLinear", "LayerNormMLP"):
        m = layer(kind)
        x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(16, 64, dtype=torch.bfloat16)

        def fp8(recipe, one_call=True):
            def run():
                _fp8_gemm.ONE_CALL = one_call
                try:
                    with te.autocast(enabled=True, recipe=recipe):
                        y = m(x)
                    y.backward(dy)
                finally:
                    _fp8_gemm.ONE_CALL = True
            return run
        cases = {"bf16": lambda: m(x).backward(dy), "FP8 delayed": fp8(DelayedScaling(amax_history_len=16)),
                 "FP8 current": fp8(Float8CurrentScaling())}
        if a.general:
            cases["FP8 delayed, general path"] = fp8(DelayedScaling(amax_history_len=16), False)
        for name in COMPUTING:
            setattr(_C, name, lambda *args: None)
        try:
            res = {name: timed(fn) for name, fn in cases.items()}
        finally:
            for name, fn in real.items():
                setattr(_C, name, fn)
        print(f"{kind:16s} " + "  ".join(f"{name} {us:6.1f}" + ("" if name == "bf16" else f" ({us / res['bf16']:.2f}x)")
                                         for name, us in res.items()))


if __name__ == "__main__":
    main()
