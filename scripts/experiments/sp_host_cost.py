"""Host cost of the sequence-parallel layers without userbuffers, "fast":
calls that are ready (module/_plan.py) against "general": the same calls
forced through the validating route (check_input, casts, the weight's
gather), on CPU ranks (gloo) at shapes so
small that the host is the bound: each layer alone (forward + backward) and
the MLP step (LayerNormLinear column -> gelu -> Linear row, as
bench_mlp's tec step; and tec.LayerNormMLP) next to PyTorch's eager TP MLP
(bench_mlp.TorchTPMLP).
Variants are interleaved, repetition by repetition, in alternating order; the median over
repetitions of the µs per step is printed by rank 0. With --ub a layer
built with ub_* flags whose communicator falls back at this shape (a huge
min_chunk_flops) is timed too.

    torchrun --nproc_per_node=2 scripts/experiments/sp_host_cost.py [--dtype bf16] [--ub]
        [--device cuda] [--profile FILE]
    python scripts/experiments/sp_host_cost.py --fake [--device cuda] ...

With --device cuda (one GPU per rank, NCCL) the same comparison runs where
the benchmark's small shapes are host-bound; the GPU is synchronised before
each timed stretch, not inside it. --profile writes rank 0's cProfile of the
fast MLP step and of PyTorch's (sorted by own time) to FILE. --trace DIR
writes, for the MLP steps and the row forwards (ours, with --loopback ours
through the engine too, and PyTorch's), a torch.profiler chrome trace of a
few steps and a table of the operators' own host time (DIR/NAME.json, .txt):
where a step's wall time goes (scripts/trace_summary.py gives the GPU's
busy time per stream).

--fake runs one process as rank 0 of a two-rank group of torch's "fake"
backend, whose collectives return at once without moving data: the host work
of everything but the collectives themselves, on one GPU (or the CPU), the
values meaningless. Both sides still make their collective calls (ours 5 per
MLP step, PyTorch's 4); --ub is not available there (a communicator needs its
peer). On CUDA the backward's host work runs on autograd's device thread:
the wall time, not the main thread's CPU time, is the measure there.

--loopback (CUDA) is --fake with real NCCL calls for every collective, on
one GPU: each of them (ours and PyTorch's) runs on a one-rank NCCL
communicator over this rank's share of the data (an all-gather fills the
first half of its output, a reduce-scatter reads the first half of its
input), so both sides pay NCCL's enqueue and what sits on top of it: the
process group's methods for PyTorch's block and our default path, the
engine's own communicator for the `*_engine` rows
(tec.set_collectives("engine")). The values are meaningless, the host work
real.

The forward rows (every mode) compare the benchmark's no-grad forwards
(layers without bias; with --ub also ub-flagged ones that fall back) with
PyTorch's sequential path (layer_norm + all_gather + matmul; matmul +
reduce_scatter).
"""
import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c.benchmarks.mlp import TorchTPMLP, all_gather_flat, reduce_scatter_flat  # noqa: E402
from transformer_engine_c._launch import init_rank  # noqa: E402
from transformer_engine_c.module import _plan, layernorm_linear, layernorm_mlp, linear  # noqa: E402

MAKE_CALL = _plan.make_call


def _validated_call(*args):
    c = MAKE_CALL(*args)
    c.ready = False
    return c


def use_fast(layers, on):
    """Ready calls (on), or every call through the validating route."""
    for mod in (linear, layernorm_linear, layernorm_mlp):
        mod.make_call = MAKE_CALL if on else _validated_call


def is_forward(name, forwards):
    base = name[:-7] if name.endswith("_engine") else name[:-6] if name.endswith("_torch") else name
    return base in forwards


def engine(fn):
    """fn with the layers' collectives through the engine's communicator."""
    return tec.distributed.with_collectives("engine", fn)


class _Loopback:
    """Stands in for the fake group's methods: each collective is a real
    NCCL call on a one-rank process group over this rank's share."""

    def __init__(self, pg):
        self.pg = pg

    def _allgather_base(self, out, x):
        return self.pg._allgather_base(out.narrow(0, 0, x.shape[0]), x)

    def _reduce_scatter_base(self, out, x):
        return self.pg._reduce_scatter_base(out, x.narrow(0, 0, out.shape[0]))

    def allreduce(self, tensors):
        return self.pg.allreduce(tensors)


def loopback(device):
    """--loopback: the layers' process-group calls, PyTorch's block's and the
    engine's communicator all become one-rank NCCL calls on `device`."""
    from transformer_engine_c import _C, distributed as d
    from transformer_engine_c.benchmarks import mlp as bench_mlp

    store = dist.HashStore()
    opts = dist.ProcessGroupNCCL.Options()
    pg = dist.ProcessGroupNCCL(store, 0, 1, opts)
    lb = _Loopback(pg)
    d._process_group = lambda group: lb
    ag = lambda out, x, group=None, async_op=False: lb._allgather_base(out, x).wait()  # noqa: E731
    rs = lambda out, x, group=None, async_op=False: lb._reduce_scatter_base(out, x).wait()  # noqa: E731
    bench_mlp.all_gather_flat = ag
    bench_mlp.reduce_scatter_flat = rs
    globals().update(all_gather_flat=ag, reduce_scatter_flat=rs)
    tec._engine.device_code(device)
    comm = _C.nccl_create(device.index or 0, _C.nccl_unique_id(), 1, 0, 600.0, "a one-rank loopback")
    for group in (None, dist.group.WORLD):  # the layers' tp group (resolve_tp) and the default
        d._engine_comms[(group, device.index or 0)] = (comm, 2)


def trace(where, steps, forwards, sync, rank, n=20):
    """--trace: a profiler trace and an operator table per variant (rank 0)."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(where, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for name in ("mlp", "mlp_engine", "mlp_torch", "lnmlp", "lnmlp_engine", "row_fwd", "row_fwd_engine", "row_fwd_torch"):
        fn = steps.get(name)
        if fn is None:
            continue
        grad = torch.no_grad() if is_forward(name, forwards) else contextlib.nullcontext()
        with grad:
            for _ in range(5):
                fn()
            sync()
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                wall = (time.perf_counter() - t0) / n * 1e6
        if rank == 0:
            prof.export_chrome_trace(os.path.join(where, name + ".json"))
            with open(os.path.join(where, name + ".txt"), "w") as fh:
                fh.write(f"{name}: {n} steps, {wall:.1f} µs per step under the profiler\n")
                fh.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--tokens", type=int, default=16, help="rows per rank")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--ub", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--trace", default=None, help="directory for torch.profiler traces (see the docstring)")
    ap.add_argument("--fake", action="store_true", help="one process, a two-rank group of torch's fake backend")
    ap.add_argument("--loopback", action="store_true", help="--fake, every collective a one-rank NCCL call (CUDA)")
    args = ap.parse_args()
    if args.loopback:
        if args.device != "cuda":
            ap.error("--loopback needs --device cuda")
        args.fake = True
    if args.fake:
        if args.ub:
            ap.error("--ub needs a peer: not with --fake")
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        rank, size = 0, 2
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    else:
        rank, size, device = init_rank(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.loopback:
        loopback(device)
    torch.manual_seed(1 + rank)
    dt = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    h, f, t = args.hidden, args.ffn, args.tokens
    kw = dict(params_dtype=dt, device=device, sequence_parallel=True, tp_size=size)
    fc1 = tec.LayerNormLinear(h, f, parallel_mode="column", **kw)
    fc2 = tec.Linear(f, h, parallel_mode="row", **kw)
    col = tec.Linear(h, f, parallel_mode="column", **kw)
    lnmlp = tec.LayerNormMLP(h, f, activation="gelu", set_parallel_mode=True, **kw)
    layers = [fc1, fc2, col, lnmlp]
    x = torch.randn(t, h, dtype=dt, device=device, requires_grad=True)
    xr = torch.randn(t * size, f // size, dtype=dt, device=device, requires_grad=True)
    dy_mlp = torch.randn(t, h, dtype=dt, device=device)
    dy_col = torch.randn(t * size, f // size, dtype=dt, device=device)
    torch_mlp = TorchTPMLP(h, f, None, dt, device)

    def mlp():
        fc2(F.gelu(fc1(x), approximate="tanh")).backward(dy_mlp)

    steps = {"mlp": mlp, "lnl_column": lambda: fc1(x).backward(dy_col),
             "linear_column": lambda: col(x).backward(dy_col), "linear_row": lambda: fc2(xr).backward(dy_mlp),
             "lnmlp": lambda: lnmlp(x).backward(dy_mlp)}
    if args.ub:
        comm = tec.CommOverlap((t * size, max(h, f)), dt, tp_size=size, device=device, min_chunk_flops=1 << 60)
        ub1 = tec.LayerNormLinear(h, f, parallel_mode="column", ub_overlap_ag=True, ub_comm=comm, **kw)
        ub2 = tec.Linear(f, h, parallel_mode="row", ub_overlap_rs=True, ub_comm=comm, **kw)
        ub3 = tec.LayerNormMLP(h, f, activation="gelu", set_parallel_mode=True, ub_overlap_ag=True, ub_overlap_rs=True,
                               ub_overlap_rs_dgrad=True, ub_comm=comm, **kw)
        layers += [ub1, ub2, ub3]
        steps["mlp_ub_fallback"] = lambda: ub2(F.gelu(ub1(x), approximate="tanh")).backward(dy_mlp)
        steps["lnmlp_ub_fallback"] = lambda: ub3(x).backward(dy_mlp)
    variants = [(name, fast) for name in steps for fast in (True, False)] + [("mlp_torch", None)]
    if args.loopback:  # our layers again, their collectives through the engine's communicator
        for name in ("mlp", "lnmlp"):
            steps[name + "_engine"] = engine(steps[name])
            variants.append((name + "_engine", True))
    # The no-grad forwards (name: (ours, PyTorch's sequential path)), without bias as that path
    nb1 = tec.LayerNormLinear(h, f, parallel_mode="column", bias=False, **kw)
    nb2 = tec.Linear(f, h, parallel_mode="row", bias=False, **kw)
    w1, g1, b1 = nb1.weight.detach(), nb1.layer_norm_weight.detach(), nb1.layer_norm_bias.detach()
    w2 = nb2.weight.detach()
    total = torch.empty(t * size, h, dtype=dt, device=device)
    part = torch.empty(t * size, h, dtype=dt, device=device)
    out = torch.empty(t, h, dtype=dt, device=device)

    def ag_sequential():
        all_gather_flat(total, F.layer_norm(x, (h,), g1, b1), group=None)
        return torch.matmul(total, w1.t())

    def rs_sequential():
        torch.matmul(xr, w2.t(), out=part)
        reduce_scatter_flat(out, part, group=None)
        return out
    forwards = {"lnl_fwd": (lambda: nb1(x), ag_sequential), "row_fwd": (lambda: nb2(xr), rs_sequential)}
    if args.ub:  # with ub flags whose communicator falls back (the benchmark's ours_overlap at small shapes)
        ub4 = tec.LayerNormLinear(h, f, parallel_mode="column", bias=False, ub_overlap_ag=True, ub_comm=comm, **kw)
        ub5 = tec.Linear(f, h, parallel_mode="row", bias=False, ub_overlap_rs=True, ub_comm=comm, **kw)
        layers += [ub4, ub5]
        forwards["lnl_fwd_ub"] = (lambda: ub4(x), ag_sequential)
        forwards["row_fwd_ub"] = (lambda: ub5(xr), rs_sequential)
    for name, (ours, seq) in forwards.items():
        variants += [(name, True), (name + "_torch", None)]
        steps[name], steps[name + "_torch"] = ours, seq
        if args.loopback:
            variants.append((name + "_engine", True))
            steps[name + "_engine"] = engine(ours)
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    def torch_step():
        torch_mlp(x).backward(dy_mlp)

    for rep in range(args.reps + 1):
        for v in (variants if rep % 2 else variants[::-1]):  # the order alternates (the wall time drifts)
            name, fast = v
            if fast is None:
                fn = steps[name] if name in steps else torch_step
            else:
                use_fast(layers, fast)
                fn = steps[name]
            grad = torch.no_grad() if is_forward(name, forwards) else contextlib.nullcontext()
            with grad:
                for _ in range(5):
                    fn()
            sync()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            with grad:
                for _ in range(args.iters):
                    fn()
            c1 = time.thread_time()
            sync()
            el = (time.perf_counter() - t0) / args.iters * 1e6
            if rep:  # the first repetition warms up
                times[v].append(el)
                cpu[v].append((c1 - c0) / args.iters * 1e6)
    use_fast(layers, True)
    if args.profile:
        profiles = []
        for name, fn in (("tec fast mlp", mlp), ("PyTorch TP MLP", torch_step)):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.iters):
                fn()
            pr.disable()
            sync()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
            profiles.append(f"== {name}, {args.iters} steps\n{buf.getvalue()}")
        if rank == 0:
            with open(args.profile, "w") as fh:
                fh.write("\n".join(profiles))
    if args.trace:
        trace(args.trace, dict(steps, mlp_torch=torch_step), forwards, sync, rank)
    if rank == 0:
        print(f"{dist.get_backend()}{' (one process)' if args.fake else ''}, {size} ranks, {args.dtype}, {t} rows/rank, hidden {h}, ffn {f}: median µs per fwd+bwd step "
              f"over {args.reps} interleaved repetitions of {args.iters}; main-thread CPU µs (the host work; "
              "gloo's collectives run on its own threads) and wall µs (GPU: issue time)")
        for what, tab in (("main-thread CPU", cpu), ("wall", times)):
            print(f" {what}:")
            for name in steps:
                if is_forward(name, forwards) or name.endswith("_engine"):
                    continue
                fa, ge = statistics.median(tab[(name, True)]), statistics.median(tab[(name, False)])
                print(f"  {name:16s} fast {fa:8.1f}  general {ge:8.1f}  general/fast {ge / fa:5.2f}x")
            tm = statistics.median(tab[("mlp_torch", None)])
            fa = statistics.median(tab[("mlp", True)])
            ln = statistics.median(tab[("lnmlp", True)])
            print(f"  mlp_torch        {tm:8.1f}  (torch / tec fast {tm / fa:5.2f}x, torch / LayerNormMLP fast "
                  f"{tm / ln:5.2f}x)")
            if args.loopback:
                fe, le = statistics.median(tab[("mlp_engine", True)]), statistics.median(tab[("lnmlp_engine", True)])
                print(f"  engine           mlp {fe:8.1f}  lnmlp {le:8.1f}  (torch / tec {tm / fe:5.2f}x, "
                      f"torch / LayerNormMLP {tm / le:5.2f}x)")
            for name in forwards:
                ours, seq = statistics.median(tab[(name, True)]), statistics.median(tab[(name + "_torch", None)])
                line = f"  {name:16s} ours {ours:8.1f}  PyTorch sequential {seq:8.1f}  (PyTorch / ours {seq / ours:5.2f}x"
                if args.loopback:
                    eng = statistics.median(tab[(name + "_engine", True)])
                    line += f"; engine {eng:8.1f}, PyTorch / engine {seq / eng:5.2f}x"
                print(line + ")")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
