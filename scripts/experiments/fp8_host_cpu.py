"""The host cost per call of FP8 on the CPU, against the same calls in bf16,
in interleaved rounds of one process (least and median, µs per call):

* the FP8 bookkeeping of a graphed replay (graph.py's replay protocol around
  a stand-in for the graph: a cheap autograd op, so what is timed is the
  autocast, the registration, the first-module hook and the two delayed
  updates) for N registered LayerNormMLP layers, and its pieces;
  DelayedScaling(amax_history_len=16) throughout (HISTORY);
* an eager FP8 forward+backward of each layer at [16, 64] (DelayedScaling
  and Float8CurrentScaling) against bf16.

    python3 scripts/experiments/fp8_host_cpu.py [--rounds 15] [--modules 1 4] [--profile CASE]
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch

import transformer_engine_c as te
from transformer_engine_c import graph
from transformer_engine_c.quantization import FP8GlobalStateManager as G
from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling


def timed(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def interleaved(cases, rounds, n):
    """{name: (least, median)} of `cases` ({name: fn}), each timed over n
    calls per round, the order reversed every other round."""
    for fn in cases.values():
        timed(fn, 10)
    times = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(cases[name], n))
    return {name: (min(v), statistics.median(v)) for name, v in times.items()}


# A short amax history: the CPU's delayed update computes over every row (on a GPU it is one launch
# whatever the length), and the host cost is what is measured here.
HISTORY = 16


class _Standin(torch.autograd.Function):
    """What a graph replay is to the host here: one autograd node."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def graphed_standin(layer, recipe, fp8):
    """layer under graph.py's replay protocol, replaying _Standin instead of
    a graph; with fp8, its fp8_meta made by one eager FP8 call first and the
    replay's FP8 bookkeeping on (a graphed bf16 layer without)."""
    if fp8:
        x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(enabled=True, recipe=recipe):
            layer(x).sum().backward()
    layer.forward = graph._Replay(layer, _Standin.apply, None, layer.training, fp8, None)
    return layer


def bookkeeping_cases(n_modules):
    G.reset()
    rec = DelayedScaling(amax_history_len=HISTORY)
    layers = [graphed_standin(te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16), rec, True)
              for _ in range(n_modules)]
    plain = [graphed_standin(te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16), rec, False)
             for _ in range(n_modules)]
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 64, dtype=torch.bfloat16)

    def fp8_step():
        with te.autocast(enabled=True, recipe=rec):
            y = x
            for m in layers:
                y = m(y)
        y.backward(dy)

    def plain_step():
        y = x
        for m in plain:
            y = m(y)
        y.backward(dy)

    def empty_autocast():
        with te.autocast(enabled=True, recipe=rec):
            pass

    def register():
        for m in layers:
            graph.register_fp8_metas(m)

    def backward_update():
        G.reduce_and_update_fp8_tensors(forward=False)

    G.autocast_enter(enabled=True, fp8_recipe=rec)  # the registration's state, left as it was after
    try:
        register()
    finally:
        G.autocast_exit(False)
    with te.autocast(enabled=True, recipe=rec):
        state = G.get_autocast_state()

    def register_in_autocast():
        saved = G.get_autocast_state()
        G.set_autocast_state(state)
        register()
        G.set_autocast_state(saved)

    return {f"graphed step, FP8, {n_modules} modules": fp8_step,
            f"graphed step, bf16, {n_modules} modules": plain_step,
            f"  autocast enter+exit (forward update), {n_modules} metas": empty_autocast,
            f"  registration of {n_modules} modules (registered)": register_in_autocast,
            f"  backward update, {n_modules} metas": backward_update}


def layer(kind):
    torch.manual_seed(0)
    if kind == "Linear":
        return te.Linear(64, 64, params_dtype=torch.bfloat16)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16)
    return te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16)


def eager_cases(kind):
    m = layer(kind)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 64, dtype=torch.bfloat16)
    delayed, current = DelayedScaling(amax_history_len=HISTORY), Float8CurrentScaling()

    def step(recipe):
        def run():
            with te.autocast(enabled=True, recipe=recipe):
                y = m(x)
            y.backward(dy)
        return run
    return {f"{kind} bf16 fwd+bwd": lambda: m(x).backward(dy), f"{kind} FP8 delayed fwd+bwd": step(delayed),
            f"{kind} FP8 current fwd+bwd": step(current)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--modules", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--profile", help="a case name (its start) to profile with cProfile instead")
    a = ap.parse_args()
    torch.set_num_threads(1)
    groups = [(lambda n=n: bookkeeping_cases(n), 400) for n in a.modules]
    groups += [(lambda k=k: eager_cases(k), 100) for k in ("Linear", "LayerNormLinear", "LayerNormMLP")]
    for make, n in groups:
        cases = make()
        if a.profile:
            for name, fn in cases.items():
                if name.strip().startswith(a.profile):
                    timed(fn, 20)
                    prof = cProfile.Profile()
                    prof.runcall(timed, fn, 2000)
                    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            G.reset()
            continue
        for name, (least, med) in interleaved(cases, a.rounds, n).items():
            print(f"{name:58s} least {least:7.1f}  median {med:7.1f} us")
        G.reset()


if __name__ == "__main__":
    main()
