"""Microbenchmark: one prepare_for_saving + one restore_from_saved call over N
objects, the C implementation against a straightforward pure-Python one of the
same semantics, in the same process.

    python -m transformer_engine_c.bench_saving [--iters 100000] [--repeats 11]

Cases: N = 1, 8, 32 of plain torch.Tensor; N = 8, 32 of nn.Parameter (an
exact Parameter is plain, like an exact Tensor); N = 8, 32 mixed (every 4th a DistributedWeight, one None,
the rest plain). Reported: the best of `repeats` runs of `iters` pairs, per
pair and per object, the Python loop that drives the calls included.
"""
import argparse
import platform
import time

import torch

from .. import _C
from ..distributed_weight import DistributedWeight

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


class _PySaved:
    __slots__ = ("entries", "n_saved", "consumed")


def py_prepare_for_saving(*tensors):
    """The same semantics as _C.prepare_for_saving, written plainly."""
    out, entries = [], []
    for t in tensors:
        if t is None or type(t) is _Tensor or type(t) is _Parameter:
            out.append(t)
            entries.append(None)
        elif isinstance(t, _Tensor) and getattr(t, "is_distributed_weight", False):
            out.append(t)
            entries.append((1, t, 1))
        elif hasattr(type(t), "prepare_for_saving"):
            ts, state = t.prepare_for_saving()
            if not hasattr(state, "restore_from_saved"):
                raise TypeError("state has no restore_from_saved")
            ts = tuple(ts)
            out.extend(ts)
            entries.append((2, state, len(ts)))
        elif isinstance(t, _Tensor):
            out.append(t)
            entries.append(None)
        else:
            raise TypeError(f"expected a torch.Tensor, None or a delegating object, got {type(t).__name__}")
    saved = _PySaved()
    saved.entries, saved.n_saved, saved.consumed = entries, len(out), False
    return tuple(out), saved


def py_restore_from_saved(objects, saved_tensors):
    if not isinstance(objects, _PySaved):
        raise TypeError("expected the objects returned by prepare_for_saving")
    if objects.consumed:
        raise ValueError("already restored")
    if len(saved_tensors) != objects.n_saved:
        raise ValueError(f"expected {objects.n_saved} saved tensors, got {len(saved_tensors)}")
    objects.consumed = True
    res, pos = [], 0
    for e in objects.entries:
        if e is None:
            res.append(saved_tensors[pos])
            pos += 1
        elif e[0] == 1:
            res.append(e[1])
            pos += 1
        else:
            r = e[1].restore_from_saved(list(saved_tensors[pos:pos + e[2]]))
            res.append(e[1] if r is None else r)
            pos += e[2]
    objects.entries = None
    return res


def _time_pairs(prepare, restore, objs, iters):
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        s, o = prepare(*objs)
        restore(o, s)
    return (time.perf_counter_ns() - t0) / iters / 1000.0  # microseconds per pair


def _best(objs, iters, repeats):
    """Best of `repeats`, C and Python runs interleaved so both see the same load."""
    c = py = float("inf")
    for _ in range(repeats):
        c = min(c, _time_pairs(_C.prepare_for_saving, _C.restore_from_saved, objs, iters))
        py = min(py, _time_pairs(py_prepare_for_saving, py_restore_from_saved, objs, iters))
    return c, py


def cases():
    plain = [torch.randn(4) for _ in range(32)]
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(32)]
    dws = [DistributedWeight(torch.randn(4)) for _ in range(8)]

    def mixed(n):
        objs = list(plain[:n])
        for i in range(0, n, 4):
            objs[i] = dws[i // 4]
        objs[1] = None
        return objs

    return [("plain", 1, plain[:1]), ("plain", 8, plain[:8]), ("plain", 32, plain[:32]),
            ("Parameter", 8, params[:8]), ("Parameter", 32, params[:32]),
            ("mixed (1/4 DistributedWeight)", 8, mixed(8)), ("mixed (1/4 DistributedWeight)", 32, mixed(32))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100000)
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args(argv)
    print(f"# {time.strftime('%Y-%m-%d')} python {platform.python_version()} torch {torch.__version__} "
          f"{platform.machine()} ({__import__('os').cpu_count()} CPUs)")
    print("| objects | N | C us/pair | C ns/object | Python us/pair | Python ns/object | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n, objs in cases():
        iters = max(args.iters // max(n // 4, 1), 1000)
        # check both agree before timing
        s, o = _C.prepare_for_saving(*objs)
        r_c = _C.restore_from_saved(o, s)
        s, o = py_prepare_for_saving(*objs)
        r_py = py_restore_from_saved(o, s)
        assert all(a is b for a, b in zip(r_c, r_py)) and len(r_c) == len(r_py)
        c, py = _best(objs, iters, args.repeats)
        print(f"| {name} | {n} | {c:.3f} | {c * 1000 / n:.1f} | {py:.3f} | {py * 1000 / n:.1f} | "
              f"{py / c:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
