"""The host cost of a graphed FP8 LayerNormMLP step taken apart (no
profiler, whose own cost hides what it measures): per step, the host time
to issue it, the main thread's and the process's CPU time, and the wall time
once the GPU is done, for the graphed bf16 step, the graphed FP8
(DelayedScaling) step, the same replayed outside an autocast (no FP8
bookkeeping), their forwards alone and an empty autocast; then the FP8 step
with its backward-amax hook replaced (none, a no-op, the update called after
backward returns: measurements only, not the semantics), in interleaved
rounds (least and median).

    python3 scripts/experiments/fp8_graph_host.py [--shape 2048x2048x6144]
"""
import argparse
import statistics
import time

import torch

import transformer_engine_c as te
from transformer_engine_c import graph, recipe as recipe_mod
from transformer_engine_c.benchmarks import fp8 as bench_fp8, tp1


def measure(fn, n):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(n):
        fn()
    host, cpu, proc = ((time.perf_counter() - t0) / n, (time.thread_time() - c0) / n,
                       (time.process_time() - p0) / n)
    torch.cuda.synchronize()
    return host, cpu, proc, (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x2048x6144")
    a = ap.parse_args()
    T, H, N = (int(v) for v in a.shape.split("x"))
    dev, dt = torch.device("cuda"), torch.bfloat16
    ours = tp1.ours_layer(te, "LayerNormMLP", H, N, dt, dev)
    x = torch.randn(T, H, dtype=dt, device=dev, requires_grad=True)
    dy = torch.randn(T, H, dtype=dt, device=dev)
    rec = recipe_mod.DelayedScaling()
    gb = te.make_graphed_callables(ours, (x,))
    g8 = te.make_graphed_callables(bench_fp8.fp8_twin(te, "LayerNormMLP", H, N, dt, dev, ours), (x,),
                                   fp8_enabled=True, fp8_recipe=rec)

    def fp8():
        with te.autocast(enabled=True, recipe=rec):
            y = g8(x)
        y.backward(dy)

    def fp8_fwd():
        with te.autocast(enabled=True, recipe=rec):
            g8(x)

    def empty_autocast():
        with te.autocast(enabled=True, recipe=rec):
            pass

    cases = {"bf16": lambda: gb(x).backward(dy), "fp8": fp8, "fp8 outside autocast": lambda: g8(x).backward(dy),
             "bf16 forward": lambda: gb(x), "fp8 forward": fp8_fwd, "empty autocast": empty_autocast}
    for name, fn in cases.items():
        host, cpu, proc, wall = measure(fn, 60)
        print(f"{name:22s} host {host * 1e6:7.1f} us  main-thread cpu {cpu * 1e6:7.1f}  "
              f"process cpu {proc * 1e6:7.1f}  wall {wall * 1e6:7.1f}")

    real_after, real_update = graph.after_backward, graph._update_backward_amaxes

    def fp8_then_update():
        fp8()
        real_update()

    def hook(fn):
        def setup():
            graph.after_backward = fn
        return setup
    variants = [("fp8 (as shipped)", fp8, None),
                ("fp8, no backward hook", fp8, hook(lambda out, fn: None)),
                ("fp8, no-op hook", fp8, hook(lambda out, fn: real_after(out, lambda: None))),
                ("fp8, update after backward", fp8_then_update, hook(lambda out, fn: None))]
    res = {}
    for rnd in range(10):
        for name, fn, setup in (variants if rnd % 2 == 0 else variants[::-1]):
            if setup:
                setup()
            try:
                res.setdefault(name, []).append(measure(fn, 40))
            finally:
                graph.after_backward = real_after
    print()
    for name, v in res.items():
        hs, ws = [r[0] for r in v], [r[3] for r in v]
        print(f"{name:28s} host least {min(hs) * 1e6:6.1f} median {statistics.median(hs) * 1e6:6.1f} us; "
              f"wall least {min(ws) * 1e6:6.1f} median {statistics.median(ws) * 1e6:6.1f}")


if __name__ == "__main__":
    main()
