"""Benchmark: comm-GEMM overlap against the non-overlapped layer, the
PyTorch sequential path, PyTorch async-TP and the limit, in one process.

    python -m transformer_engine_c.bench --out bench_out          # every GPU, or 2 CPU ranks
    python -m transformer_engine_c.bench --shapes 8192x4096x12288 --cases ag_gemm,gemm_rs,mlp
    python -m transformer_engine_c.bench --sweep                  # tokens 2048-16384, H 2048/4096/8192, N 3H/4H
    python -m transformer_engine_c.bench --cases mlp --graphs     # + CUDA-graphed MLP steps (CUDA only)
    python -m transformer_engine_c.bench --cases mlp --fp8-recipe delayed  # + LayerNormMLP in FP8 at TP>1

Shapes are TOKENSxHIDDENxN (N: the column layer's full output width). Times
are medians over --iters samples after --warmup, with CUDA events on GPUs
(host clock on CPU), the maximum over ranks. The variants of a row are timed
in interleaved rounds (one sample of each per round, every rank starting each
sample together, in an order that varies from round to round), so that the GPU's
clock and temperature drift over a run, and whatever ran just before a
sample, weigh on all of them alike. A sample is --batch calls issued
back to back, divided by --batch: the host runs ahead of the GPU as in
training, so a row measures the GPU's time unless the host cannot keep up.
--batch 1 times each call from an idle GPU instead (latency: the host's time
to issue the first kernels is then part of every number). The norm and copy
bandwidths are the GPU's time alone (see Timer.device_time). Results: a table
on stdout and bench.json, bench.md (and bench.png where matplotlib is
installed) in --out, each followed by the targets the rows are checked against.

The mlp rows also time PyTorch's own tensor-parallel MLP block (torch_mlp,
see benchmarks/mlp.py), and with --graphs (CUDA only) the step captured in a CUDA
graph and replayed: ours_graphed_no_overlap, ours_graphed_overlap (with
userbuffers overlap, on the communicators the eager step uses) and
torch_mlp_graphed. Every variant also gets its
host µs per call (the host's time to issue it, from the same samples), in a
second table.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from .._launch import init_rank, relaunch, under_torchrun
from .mlp import GRAPH_NOTE, all_gather_flat, ours_graphed_fns, reduce_scatter_flat, torch_mlp_fns

CASES = ("ag_gemm", "gemm_rs", "mlp", "mlp_bulk")
DEFAULT_CASES = ("ag_gemm", "gemm_rs", "mlp")


def parse():
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpus else "cpu")
    ap.add_argument("--nproc", type=int, default=None)
    ap.add_argument("--shapes", default=None, help="comma-separated TOKENSxHIDDENxN")
    ap.add_argument("--sweep", action="store_true", help="the full shape sweep")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help=f"comma-separated, of {', '.join(CASES)} (mlp_bulk: fc1's backward with ub_bulk_dgrad + "
                    "ub_bulk_wgrad instead of ub_overlap_rs_dgrad)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4, help="calls per timed sample (1: per-call latency)")
    ap.add_argument("--out", default=None, help="directory for bench.json / bench.md / bench.png")
    ap.add_argument("--graphs", action="store_true",
                    help="mlp rows also time the step captured in a CUDA graph and replayed: ours without "
                    "and with userbuffers overlap (ours_graphed_no_overlap, ours_graphed_overlap) and "
                    "PyTorch's TP MLP block (torch_mlp_graphed); CUDA only")
    ap.add_argument("--fp8-recipe", dest="fp8", default=None, choices=["delayed", "current"],
                    help="mlp rows also time LayerNormMLP in FP8 with this recipe, without and with overlap "
                    "(lnmlp_fp8, lnmlp_fp8_overlap: FP8 all-gathers through the FP8 communicators)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if args.graphs and not cuda:
        ap.error("--graphs needs --device cuda: CUDA graphs exist only on CUDA devices "
                 "(the CPU run has no graphed variants)")
    args.nproc = args.nproc or (gpus if cuda else 2)
    if args.sweep:
        args.shapes = [(t, h, n * h) for h in (2048, 4096, 8192) for n in (3, 4) for t in (2048, 4096, 8192, 16384)]
    elif args.shapes:
        args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        args.shapes = ([(8192, 4096, 12288), (4096, 4096, 12288), (16384, 8192, 24576), (2048, 2048, 6144)]
                       if cuda else [(256, 256, 768)])
    args.cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; expected some of {CASES}")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    args.iters = args.iters if args.iters is not None else (25 if cuda else 5)
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    return args


class Timer:
    def __init__(self, device, group, warmup, iters, batch=1, seed=None):
        """seed: of the rounds' orders; None draws one that every rank of the
        group agrees on (a collective), different from run to run."""
        import torch.distributed as dist

        self.cuda, self.device = device.type == "cuda", device
        self.group, self.warmup, self.iters, self.batch = group, warmup, iters, batch
        if seed is None:
            t = torch.tensor([random.SystemRandom().randrange(1 << 31)], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            seed = int(t.item())
        self.seed = seed

    def many(self, fns, host=None):
        """{name: median ms of fn(), max over ranks} for the dict fns, measured in
        interleaved rounds: each round takes one sample of every fn, in an order
        that varies (each fn in each position equally often, after varying
        predecessors; see _rounds). A fn that
        raises NotImplementedError in its warm-up is left out of the result.
        Every rank must pass the same names in the same order (fns may be collective).
        host: a dict that gets {name: median host µs per call, max over ranks}
        from the same samples (see sample)."""
        import torch.distributed as dist

        live = {}
        for name, fn in fns.items():
            try:
                for _ in range(self.warmup):
                    fn()
            except NotImplementedError:
                continue
            live[name] = fn

        def measure(fn):
            # Ranks start each sample together: a collective sample that follows a
            # local one would otherwise also time the other rank's lag.
            self.sync()
            dist.barrier(group=self.group)
            return self.sample(fn, self.batch)
        ms, host_us = self._rounds(live, measure)
        if host is not None:
            host.update(host_us)
        return ms

    def device_time(self, fns, calls=10, sleep_cycles=5_000_000):
        """As many(), for local (non-collective) fns, ms per call of the GPU's
        time alone: a sleep kernel (~2.5 ms) holds the stream while the host
        queues `calls` calls, so the host's time to issue them (more than a
        small kernel's run) cannot enter (without torch.cuda._sleep it can).
        On the CPU: the host clock."""
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()

        sleep = getattr(torch.cuda, "_sleep", None) if self.cuda else None  # a private PyTorch helper

        def measure(fn):
            self.sync()
            if sleep is not None:
                sleep(sleep_cycles)
            return self.sample(fn, calls)
        return self._rounds(fns, measure)[0]

    def _rounds(self, fns, measure):
        import torch.distributed as dist

        times = {name: [] for name in fns}
        hosts = {name: [] for name in fns}
        items = list(fns.items())
        n = max(1, len(items))
        for i in range(self.iters):
            # Each block of n rounds rotates one shuffled order: every fn takes
            # every position once per block, and what precedes it changes from
            # block to block. The order depends on the seed and the round only,
            # so it is the same on every rank.
            k = i % n
            perm = random.Random(self.seed * 1_000_003 + i // n).sample(items, len(items))
            for name, fn in perm[k:] + perm[:k]:
                ms, host_us = measure(fn)
                times[name].append(ms)
                hosts[name].append(host_us)
        t = torch.tensor([statistics.median(v[n]) for v in (times, hosts) for n in fns] or [0.0],
                         dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        t = t.tolist()
        return dict(zip(fns, t[:len(fns)])), dict(zip(fns, t[len(fns):]))

    def sample(self, fn, calls):
        """(ms per call, host µs per call) over `calls` calls issued back to
        back, from whatever the device was doing (idle after sync()). The host
        time is the host clock from the first call's start to the last one's
        return, before anything waits for the GPU: the time to issue a call
        (on the CPU device, the whole call; on a GPU it includes any wait a
        call itself makes, e.g. for a full launch queue)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - t0
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / calls, host * 1e6 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - t0
        return host * 1e3 / calls, host * 1e6 / calls

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def _symm_mem(group):
    """PyTorch async-TP ops for `group`, or None where unavailable."""
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group.group_name)
        return torch.ops.symm_mem
    except Exception:  # not built, not on this device, or no symmetric memory
        return None


def _ub_layers(tec, kind, size, group, T, H, N, dtype, device, overlap, fp8=False):
    """Our layers for a case, with or without userbuffers overlap (with fp8
    the registry also has the FP8 communicators)."""
    ub = {}
    if overlap:
        if not hasattr(tec, "initialize_ub"):
            raise NotImplementedError
        tec.destroy_ub()
        mode = tec.UserBufferQuantizationMode
        modes = [mode.NONE, mode.FP8] if fp8 else [mode.NONE]
        tec.initialize_ub([T, max(H, N // size)], size, dtype=dtype, tp_group=group, device=device,
                          quantization_modes=modes)
    fc1 = fc2 = None
    mlp = kind in ("mlp", "mlp_bulk")
    # The ag_gemm / gemm_rs rows compare a layer with PyTorch's sequential path, which has no
    # bias: the layers there have none either (the mlp rows' layers and PyTorch's block have biases).
    bias = mlp
    if kind == "ag_gemm" or mlp:
        if overlap:  # fc1's backward: dgrad GEMM+RS (mlp), or bulk AG during dgrad + bulk RS during wgrad
            ub = dict(ub_overlap_ag=True, ub_overlap_rs_dgrad=kind == "mlp", ub_bulk_dgrad=kind == "mlp_bulk",
                      ub_bulk_wgrad=kind == "mlp_bulk", ub_name="fc1")
        fc1 = tec.LayerNormLinear(H, N, bias=bias, params_dtype=dtype, device=device, parallel_mode="column",
                                  sequence_parallel=True, tp_group=group, **ub)
    if kind == "gemm_rs" or mlp:
        if overlap:
            ub = dict(ub_overlap_rs=True, ub_overlap_ag=mlp, ub_name="fc2")
        fc2 = tec.Linear(N, H, bias=bias, params_dtype=dtype, device=device, parallel_mode="row",
                         sequence_parallel=True, tp_group=group, **ub)
    return fc1, fc2


def _lnmlp_fns(tec, case, size, group, H, N, dtype, device, x, dy, with_overlap, fp8=None):
    """{"lnmlp", "lnmlp_overlap"}: the same MLP step through tec.LayerNormMLP
    (gelu), without and with overlap (the registry _ub_layers made: fc1_* and
    fc2_*, the same flags as the two-layer block's); with fp8 (a recipe name)
    also "lnmlp_fp8" and "lnmlp_fp8_overlap", the step in FP8 (the FP8
    communicators)."""
    if not hasattr(tec, "LayerNormMLP"):
        return {}
    fns = {}
    variants = [("lnmlp", False, None), ("lnmlp_overlap", True, None)]
    if fp8:
        variants += [("lnmlp_fp8", False, fp8), ("lnmlp_fp8_overlap", True, fp8)]
    for name, overlap, recipe in variants:
        if overlap and not with_overlap:
            continue
        ub = {}
        if overlap:
            ub = dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=case == "mlp",
                      ub_bulk_dgrad=case == "mlp_bulk", ub_bulk_wgrad=case == "mlp_bulk")
        m = tec.LayerNormMLP(H, N, activation="gelu", params_dtype=dtype, device=device, set_parallel_mode=True,
                             sequence_parallel=True, tp_group=group, tp_size=size, **ub)

        if recipe is None:
            def step(m=m):
                m(x).backward(dy)
        else:
            rec = {"delayed": tec.recipe.DelayedScaling, "current": tec.recipe.Float8CurrentScaling}[recipe]()

            def step(m=m, rec=rec):
                with tec.autocast(recipe=rec, amax_reduction_group=group):
                    y = m(x)
                y.backward(dy)
        fns[name] = step
    return fns


def _paths(tec):
    """Overlapped and fallback calls so far, over the registry's communicators."""
    st = [tec.get_ub(n).stats() for n in tec.LAYER_NAMES]
    return (sum(s["ag_overlap"] + s["rs_overlap"] + s["bulk_ag"] + s["bulk_rs"] for s in st),
            sum(s["ag_fallback"] + s["rs_fallback"] for s in st))


def _path(before, after):
    """Which path the overlapped layer took: what stats() counted."""
    ran = [name for name, b, a in zip(("overlap", "fallback"), before, after) if a > b]
    return "+".join(ran) or "-"


def time_row(tec, row, timer, fns):
    """row.update(timer.many(fns)), row["host_us"]: {variant: host µs per
    call} from the same samples, and row["path"]: which paths the overlapped
    layer ("ours_overlap") took."""
    before = _paths(tec) if "ours_overlap" in fns else None
    row["host_us"] = {}
    row.update(timer.many(fns, host=row["host_us"]))
    if before is not None:
        row["path"] = _path(before, _paths(tec))


def ours_fns(make, w, x):
    """{"ours", "ours_overlap"}: the forward (no_grad) of our layer make(overlap)
    with weight w on input x, without and with overlap (where it exists)."""
    fns = {}
    for name, overlap in (("ours", False), ("ours_overlap", True)):
        try:
            layer = make(overlap)
        except NotImplementedError:
            continue
        with torch.no_grad():
            layer.weight.copy_(w)

        def fwd(layer=layer):
            with torch.no_grad():
                return layer(x)
        fns[name] = fwd
    return fns


def pg_variant(tec, fn, device):
    """fn with the layers' collectives through the process group
    (tec.set_collectives("torch")), for the `*_pg` rows: the same layers, the
    route before the engine's own NCCL communicator became the default, in
    the same run. None off CUDA (CPU tensors always take the process group)."""
    if device.type != "cuda" or not hasattr(tec.distributed, "with_collectives"):
        return None
    return tec.distributed.with_collectives("torch", fn)


def add_pg_variants(tec, fns, names, device):
    for name in names:
        if name in fns:
            run = pg_variant(tec, fns[name], device)
            if run is not None:
                fns[name + "_pg"] = run


def run_shape(tec, case, T, H, N, args, rank, size, device, group, timer, symm):
    dtype = args.dtype
    Nl = N // size
    g = torch.Generator(device=device).manual_seed(rank)
    rnd = lambda *s: torch.randn(*s, dtype=dtype, device=device, generator=g)  # noqa: E731
    row = {"case": case, "tokens": T, "hidden": H, "n": N, "tp": size, "dtype": str(dtype)[6:]}
    if case == "ag_gemm":
        x, w, gamma, beta = rnd(T // size, H), rnd(Nl, H) * 0.02, rnd(H), rnd(H)
        ln = F.layer_norm(x, (H,), gamma, beta)
        ln_total = torch.empty(T, H, dtype=dtype, device=device)
        nbytes = x.numel() * x.element_size()
        src = torch.empty(nbytes * 4, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)

        def sequential():
            lo = F.layer_norm(x, (H,), gamma, beta)
            all_gather_flat(ln_total, lo, group=group)
            return torch.matmul(ln_total, w.t())
        fns = {"norm": lambda: F.layer_norm(x, (H,), gamma, beta),
               "comm": lambda: all_gather_flat(ln_total, ln, group=group),
               "gemm": lambda: torch.matmul(ln_total, w.t()),
               "sequential": sequential}
        if symm is not None:
            wt = w.t()
            fns["async_tp"] = lambda: symm.fused_all_gather_matmul(
                F.layer_norm(x, (H,), gamma, beta), [wt], gather_dim=0, group_name=group.group_name)
        fns.update(ours_fns(lambda ov: _ub_layers(tec, case, size, group, T, H, N, dtype, device, ov)[0], w, x))
        fns["ours_gemm"] = lambda: tec._engine.gemm(ln_total, w, transb=True)
        add_pg_variants(tec, fns, ("ours_overlap",), device)
        time_row(tec, row, timer, fns)
        row["limit"] = row["norm"] + max(row["comm"], row["gemm"])
        # Bandwidths from the GPU's time alone: issuing a norm call takes the
        # host longer than the kernel runs at these sizes.
        # The copy: four times the norm's bytes (what the machine reaches) and
        # the norm's own bytes (the same size, the same launch gaps).
        same = torch.empty_like(x)
        bw = timer.device_time({"ours_norm": lambda: tec._engine.norm_fwd(x, gamma, beta, 1e-5),
                                "copy": lambda: dst.copy_(src), "copy_same": lambda: same.copy_(x)})
        row["ours_norm"] = bw["ours_norm"]
        row["copy_gbps"] = 2 * src.numel() / bw["copy"] / 1e6
        row["copy_same_gbps"] = 2 * nbytes / bw["copy_same"] / 1e6
        row["norm_gbps"] = 2 * nbytes / bw["ours_norm"] / 1e6
    elif case == "gemm_rs":
        x, w = rnd(T, Nl), rnd(H, Nl) * 0.02
        part = torch.empty(T, H, dtype=dtype, device=device)
        out = torch.empty(T // size, H, dtype=dtype, device=device)

        def sequential():
            torch.matmul(x, w.t(), out=part)
            reduce_scatter_flat(out, part, group=group)
        fns = {"gemm": lambda: torch.matmul(x, w.t(), out=part),
               "comm": lambda: reduce_scatter_flat(out, part, group=group),
               "sequential": sequential}
        if symm is not None:
            wt = w.t()
            fns["async_tp"] = lambda: symm.fused_matmul_reduce_scatter(
                x, wt, "sum", scatter_dim=0, group_name=group.group_name)
        fns.update(ours_fns(lambda ov: _ub_layers(tec, case, size, group, T, H, N, dtype, device, ov)[1], w, x))
        add_pg_variants(tec, fns, ("ours_overlap",), device)
        time_row(tec, row, timer, fns)
        row["limit"] = max(row["gemm"], row["comm"])
    else:  # mlp / mlp_bulk forward + backward
        x = rnd(T // size, H).requires_grad_()
        dy = rnd(T // size, H)
        fns, layers = {}, {}
        for name, overlap in (("ours", False), ("ours_overlap", True)):
            try:
                layers[name] = fc1, fc2 = _ub_layers(tec, case, size, group, T, H, N, dtype, device, overlap,
                                                     bool(args.fp8))
            except NotImplementedError:
                continue

            def step(fc1=fc1, fc2=fc2):
                y = fc2(F.gelu(fc1(x)))
                y.backward(dy)
            fns[name] = step
        fns.update(_lnmlp_fns(tec, case, size, group, H, N, dtype, device, x, dy, "ours_overlap" in fns,
                              args.fp8))
        fns.update(torch_mlp_fns(H, N, group, dtype, device, x, dy, args.graphs))
        add_pg_variants(tec, fns, ("ours_overlap", "lnmlp_overlap"), device)
        if args.graphs:  # the same layers, captured (their communicators shared with the eager step)
            for name, graphed in (("ours", "ours_graphed_no_overlap"), ("ours_overlap", "ours_graphed_overlap")):
                if name in layers:
                    fns.update(ours_graphed_fns(tec, *layers[name], x, dy, graphed))
        if "ours_overlap" in fns:  # the saved-tensor aliasing checker's cost on the same step
            overlapped = fns["ours_overlap"]

            def checked():
                with tec.debug.check_saved_tensors():
                    overlapped()
            fns["checked"] = checked
        time_row(tec, row, timer, fns)
        if "checked" in row:
            row["checker_overhead_pct"] = 100 * (row["checked"] / row["ours_overlap"] - 1)
        if row.get("lnmlp") and row.get("lnmlp_overlap"):
            row["lnmlp_speedup"] = row["lnmlp"] / row["lnmlp_overlap"]
        if row.get("lnmlp") and row.get("ours"):
            row["lnmlp_vs_two_layer"] = row["ours"] / row["lnmlp"]
        if row.get("lnmlp_fp8") and row.get("lnmlp_fp8_overlap"):  # FP8 with overlap over FP8 without
            row["fp8_overlap_speedup"] = row["lnmlp_fp8"] / row["lnmlp_fp8_overlap"]
        if row.get("lnmlp_fp8_overlap") and row.get("lnmlp_overlap"):  # FP8 over bf16, both overlapped
            row["fp8_vs_bf16"] = row["lnmlp_overlap"] / row["lnmlp_fp8_overlap"]
        # PyTorch's eager TP MLP block over ours (eager: LayerNormMLP's step, overlapped where it can;
        # graphed: the faster of our graphed steps), PyTorch's graphed block over our graphed step, and
        # graphed without overlap over graphed with
        lnmlp = row.get("lnmlp_overlap") or row.get("lnmlp")
        graphed = [row[k] for k in ("ours_graphed_no_overlap", "ours_graphed_overlap") if row.get(k)]
        graphed = min(graphed) if graphed else None
        for key, mine, base in (("lnmlp_vs_torch_mlp", lnmlp, "torch_mlp"),
                                ("graphed_vs_torch_mlp", graphed, "torch_mlp"),
                                ("graphed_vs_torch_graphed", graphed, "torch_mlp_graphed"),
                                ("graphed_overlap_speedup", row.get("ours_graphed_overlap"),
                                 "ours_graphed_no_overlap")):
            if mine and row.get(base):
                row[key] = row[base] / mine
    for base in ("ours", "sequential", "async_tp", "limit", "torch_mlp"):
        if row.get("ours_overlap") and row.get(base):
            row[f"speedup_vs_{base}"] = row[base] / row["ours_overlap"]
    # Our eager layers / steps against PyTorch's eager path, with either collectives
    base = "sequential" if case in ("ag_gemm", "gemm_rs") else "torch_mlp"
    for mine in ("ours_overlap", "ours_overlap_pg", "lnmlp_overlap", "lnmlp_overlap_pg"):
        if row.get(mine) and row.get(base):
            row[f"{base}_over_{mine}"] = row[base] / row[mine]
    return row


COLUMNS = ("case", "tokens", "hidden", "n", "tp", "norm", "comm", "gemm", "limit", "sequential", "async_tp",
           "ours", "ours_overlap", "path", "speedup_vs_ours", "speedup_vs_sequential", "speedup_vs_async_tp",
           "speedup_vs_limit", "ours_gemm", "norm_gbps", "copy_gbps", "copy_same_gbps", "checked",
           "checker_overhead_pct", "lnmlp", "lnmlp_overlap", "lnmlp_speedup", "lnmlp_vs_two_layer",
           "torch_mlp", "speedup_vs_torch_mlp", "lnmlp_vs_torch_mlp", "ours_graphed_no_overlap",
           "ours_graphed_overlap", "graphed_overlap_speedup", "torch_mlp_graphed", "graphed_vs_torch_mlp",
           "graphed_vs_torch_graphed", "ours_overlap_pg", "lnmlp_overlap_pg",
           "sequential_over_ours_overlap_pg", "torch_mlp_over_ours_overlap_pg",
           "torch_mlp_over_lnmlp_overlap_pg", "lnmlp_fp8", "lnmlp_fp8_overlap", "fp8_overlap_speedup", "fp8_vs_bf16")


def fmt(v):
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _us(v):
    return "-" if v is None else f"{v:.1f}"


def host_table(rows):
    """Host µs per call of every variant (a column each, "-" where a row has
    none): the host's time to issue the call, from the same samples."""
    names = []
    for r in rows:
        names += [n for n in r.get("host_us", {}) if n not in names]
    cols = ["case", "tokens", "hidden", "n", "tp"]
    lines = ["| " + " | ".join(cols + [f"{n} host_us" for n in names]) + " |", "|" + "---|" * (len(cols) + len(names))]
    lines += ["| " + " | ".join([fmt(r.get(c)) for c in cols] + [_us(r.get("host_us", {}).get(n)) for n in names])
              + " |" for r in rows]
    return "\n".join(lines)


HEADLINE = (8192, 4096, 12288)
SMALL = (2048, 2048, 6144)  # the host-bound shape of the graphed-step target
MLP_HEADLINE = (8192, 4096, 16384)  # LayerNormMLP's targets: TP=2


def targets(rows):
    """The performance targets that a row
    of this run can be checked against: [{"target", "row", "value", "need",
    "met"}]. Every row: not slower than no overlap; ag_gemm rows: our GEMM
    against torch.matmul and the norm kernel against a copy; at the headline
    shape, TP=2: AG+GEMM 1.15x over sequential; TP=4: AG+GEMM within 1.10x
    of the limit and 1.5x over
    sequential, GEMM+RS 1.5x over sequential and 1.9x over async-TP, the MLP
    1.25x over no overlap; mlp rows at 8192x4096x16384, TP=2:
    LayerNormMLP 1.20x over itself without overlap, and without overlap no
    slower than the two-layer block; every row not slower than
    PyTorch's eager sequential path / TP MLP block, the graphed MLP step 1.5x
    over PyTorch's eager block at 2048x2048x6144 TP=2, and graphed with
    overlap not slower than graphed without at the headline shape. They are set for H200s: on the CPU they are
    reported, not meant. (The checker's cost has its own benchmark,
    benchmarks/checker.py.)"""
    out = []

    def check(row, target, value, need, note=None):
        if value is not None or note:
            out.append({"target": target, "row": f"{row['case']} {row['tokens']}x{row['hidden']}x{row['n']} "
                        f"tp={row['tp']}", "value": value, "need": need,
                        "met": None if value is None else value >= need, **({"note": note} if note else {})})
    for r in rows:
        shape = (r["tokens"], r["hidden"], r["n"])
        # the eager layers and MLP step never slower than plain PyTorch
        check(r, "eager: not slower than PyTorch's sequential path (sequential / ours_overlap)",
              r.get("speedup_vs_sequential"), 1.0)
        check(r, "eager: MLP step not slower than PyTorch's TP MLP (torch_mlp / ours_overlap)",
              r.get("speedup_vs_torch_mlp"), 1.0)
        check(r, "eager: LayerNormMLP not slower than PyTorch's TP MLP (torch_mlp / lnmlp)",
              r.get("lnmlp_vs_torch_mlp"), 1.0)
        # the same with the layers' collectives through the process group (set_collectives("torch"))
        for key, what in (("sequential_over_ours_overlap_pg", "layer or step / PyTorch's sequential path"),
                          ("torch_mlp_over_ours_overlap_pg", "MLP step / PyTorch's TP MLP"),
                          ("torch_mlp_over_lnmlp_overlap_pg", "LayerNormMLP / PyTorch's TP MLP")):
            if r["case"] in ("ag_gemm", "gemm_rs") or key.startswith("torch_mlp"):
                check(r, f"eager, process-group collectives: {what} ({key})", r.get(key), 1.0)
        if r["case"] == "mlp" and r["tp"] == 2 and shape == SMALL:
            check(r, "TP=2: graphed MLP step against PyTorch's eager TP MLP "
                  "(torch_mlp / the faster of ours_graphed_*)", r.get("graphed_vs_torch_mlp"), 1.5)
        if r["case"] == "mlp" and r["tp"] == 2 and shape == HEADLINE:
            check(r, "TP=2: graphed with overlap not slower than graphed without overlap "
                  "(ours_graphed_no_overlap / ours_graphed_overlap)", r.get("graphed_overlap_speedup"), 1.0)
        check(r, "not slower than without overlap (ours / ours_overlap)", r.get("speedup_vs_ours"), 1.0)
        check(r, "LayerNormMLP not slower than without overlap (lnmlp / lnmlp_overlap)", r.get("lnmlp_speedup"), 1.0)
        if r["case"] == "mlp" and r["tp"] == 2:  # the FP8 rows (--fp8-recipe)
            check(r, "TP=2: FP8 LayerNormMLP with overlap over FP8 without (lnmlp_fp8 / lnmlp_fp8_overlap)",
                  r.get("fp8_overlap_speedup"), 1.25)
            check(r, "TP=2: FP8 LayerNormMLP over bf16, both overlapped (lnmlp_overlap / lnmlp_fp8_overlap)",
                  r.get("fp8_vs_bf16"), 1.5)
        if (r["tokens"], r["hidden"], r["n"]) == MLP_HEADLINE and r["tp"] == 2 and r["case"] == "mlp":
            check(r, "TP=2: LayerNormMLP faster than without overlap", r.get("lnmlp_speedup"), 1.20)
            check(r, "TP=2: LayerNormMLP without overlap no slower than the two-layer block (ours / lnmlp)",
                  r.get("lnmlp_vs_two_layer"), 1.0)
        if r["case"] == "ag_gemm":
            if r.get("gemm") and r.get("ours_gemm"):
                check(r, "our GEMM against torch.matmul (gemm / ours_gemm)", r["gemm"] / r["ours_gemm"], 0.95)
            for key, size in (("copy_gbps", "4x its bytes"), ("copy_same_gbps", "its bytes")):
                if r.get("norm_gbps") and r.get(key):
                    check(r, f"norm kernel bandwidth against a copy's ({size})", r["norm_gbps"] / r[key], 0.80)
        if (r["tokens"], r["hidden"], r["n"]) != HEADLINE:
            continue
        if r["tp"] == 2 and r["case"] == "ag_gemm":
            check(r, "TP=2: faster than sequential", r.get("speedup_vs_sequential"), 1.15)
        if r["tp"] == 4:
            if r["case"] == "ag_gemm":
                check(r, "TP=4: within 1.10x of the limit (limit / ours_overlap)", r.get("speedup_vs_limit"),
                      1 / 1.10)
                check(r, "TP=4: faster than sequential", r.get("speedup_vs_sequential"), 1.5)
            if r["case"] == "gemm_rs":
                check(r, "TP=4: faster than sequential", r.get("speedup_vs_sequential"), 1.5)
                check(r, "TP=4: faster than async-TP", r.get("speedup_vs_async_tp"), 1.9)
            if r["case"] == "mlp":
                check(r, "TP=4: MLP faster than without overlap", r.get("speedup_vs_ours"), 1.25)
    return out


def targets_table(checks):
    lines = ["| target | row | measured | needed | met |", "|---|---|---|---|---|"]
    lines += [f"| {c['target']} | {c['row']} | {c.get('note') or format(c['value'], '.3f')} | {c['need']:.3f} | "
              f"{'-' if c['met'] is None else 'yes' if c['met'] else 'NO'} |" for c in checks]
    return "\n".join(lines)


def tec_collectives():
    """The layers' collectives setting (tec.set_collectives) this run had."""
    from transformer_engine_c import distributed
    return distributed.collectives()


def write(rows, checks, args, out):
    os.makedirs(out, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "warmup": args.warmup, "iters": args.iters, "batch": args.batch,
            "graphs": args.graphs, "collectives": tec_collectives()}
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "targets": checks}, f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(f"# transformer_engine_c benchmark\n\n{json.dumps(meta)}\n\nTimes in ms (median, max over "
                f"ranks); speedups are baseline time / overlapped time.\n\n{table(rows)}\n\n"
                f"## Host µs per call\n\nThe host's time to issue one call (median, max over ranks; on the "
                f"CPU the whole call); {GRAPH_NOTE}.\n\n{host_table(rows)}\n\n"
                f"## Targets (set for H200s)\n\n{targets_table(checks)}\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(max(6, len(rows)), 4))
    labels = [f"{r['case']}\n{r['tokens']}x{r['hidden']}x{r['n']}" for r in rows]
    keys = [k for k in ("sequential", "async_tp", "ours", "ours_overlap", "limit") if any(r.get(k) for r in rows)]
    width = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(k) or 0 for r in rows], width, label=k)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bench.png"), dpi=120)


def worker(args):
    import torch.distributed as dist

    import transformer_engine_c as tec

    rank, size, device = init_rank(args.device)
    group = dist.new_group(list(range(size)))
    timer = Timer(device, group, args.warmup, args.iters, args.batch)
    symm = _symm_mem(group) if device.type == "cuda" else None
    rows = []
    todo = [(c, s) for s in args.shapes for c in args.cases]
    for i, (case, (T, H, N)) in enumerate(todo):
        if T % size or N % size:
            continue
        if rank == 0:
            print(f"[{i + 1}/{len(todo)}] {case} {T}x{H}x{N} tp={size} ...", flush=True)
        rows.append(run_shape(tec, case, T, H, N, args, rank, size, device, group, timer, symm))
    if hasattr(tec, "destroy_ub"):
        tec.destroy_ub()
    if rank == 0:
        checks = targets(rows)
        print(table(rows))
        print("\nhost µs per call (the time to issue it):\n" + host_table(rows))
        print("\ntargets (set for H200s):\n" + targets_table(checks))
        if args.out:
            write(rows, checks, args, args.out)
            print(f"wrote {args.out}/bench.json, bench.md")
    dist.destroy_process_group()
    return 0


def main():
    args = parse()
    if not under_torchrun():
        return relaunch("transformer_engine_c.bench", args.nproc)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
