"""torchrun runner: the layers' fast path (module/_fast.py) under sequence
parallelism without userbuffers equals the general path bit for bit:
column and row Linear, LayerNormLinear (LayerNorm and RMSNorm, column and
row; without a parallel mode) and LayerNormMLP (set_parallel_mode; gelu,
swiglu, relu, clamped_swiglu), with and without bias, fp32 and bf16, 2-D and 3-D inputs, plain,
fused (main_grad) and delayed (backward_dw) weight gradients, return_bias,
a frozen weight, an input without grad and zero_centered_gamma; the fast path must be taken.
Prints "PASS run_fast_sp" on success.

    torchrun --nproc_per_node=2 tests/distributed/run_fast_sp.py [--device cuda]
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c.module import _fast  # noqa: E402
import common  # noqa: E402
from common import setup  # noqa: E402

IN, OUT = 24, 20
FFN = 40  # LayerNormMLP's


def make(kind, mode, dtype, rank, size, **kw):
    torch.manual_seed(7 + rank)
    if kind == "mlp":
        m = tec.LayerNormMLP(IN, FFN, params_dtype=dtype, set_parallel_mode=True, sequence_parallel=True,
                             tp_size=size, **kw)
    elif kind == "linear":
        m = tec.Linear(IN, OUT, params_dtype=dtype, parallel_mode=mode, sequence_parallel=True, tp_size=size, **kw)
    else:
        m = tec.LayerNormLinear(IN, OUT, params_dtype=dtype, parallel_mode=mode, sequence_parallel=True,
                                tp_size=size, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return m


def general(m, on):
    """Send m through the general path (on) or back to the fast one."""
    _fast.make_plan = (lambda layer: False) if on else MAKE_PLAN
    m.__dict__["_plan"] = None


def took_fast(y):
    fn = y.grad_fn
    return fn is not None and getattr(fn, "_forward_cls", None) in (_fast._LinearFn, _fast._LayerNormLinearFn,
                                                                    _fast._LayerNormMLPSPFn)


def run(m, x, dy, wgrad, first, rb):
    """Outputs, x.grad and every gradient one forward + backward leaves
    (main_grad with fuse, backward_dw's with delay), and whether the fast
    path ran."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    m.zero_grad(set_to_none=True)
    if wgrad == "fuse":
        m.weight.main_grad = torch.full(m.weight.shape, 0.25)
        m.weight.grad_added_to_main_grad = False
        m.weight.zero_out_wgrad = True
    out = m(x, is_first_microbatch=first)
    y = out[0] if rb else out
    took = took_fast(y)
    y.backward(dy)
    res = [y.detach()] + ([out[1].detach()] if rb else []) + [x.grad]
    if wgrad == "fuse":
        assert m.weight.grad_added_to_main_grad is True
        res.append(m.weight.main_grad.clone())
    if wgrad == "delay":
        m.backward_dw()
    res += [p.grad for _, p in m.named_parameters()]
    with torch.no_grad():
        o = m(x, is_first_microbatch=first)
    res.append((o[0] if rb else o).detach())
    return res, took


def same(a, b, what):
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b)):
        if u is None or v is None:
            assert u is None and v is None, f"{what}: item {i} is None on one path only"
        else:
            assert u.shape == v.shape and u.dtype == v.dtype, \
                f"{what}: item {i} {u.shape}/{u.dtype} vs {v.shape}/{v.dtype}"
            assert torch.equal(u, v), f"{what}: item {i} differs (max {(u.float() - v.float()).abs().max().item()})"


def case(kind, mode, norm, bias, dtype, shape3, wgrad, first, extra, rank, size):
    kw = {"bias": bias}
    if kind == "lnl":
        kw["normalization"] = norm
    if wgrad == "fuse":
        kw["fuse_wgrad_accumulation"] = True
    elif wgrad == "delay":
        kw["delay_wgrad_compute"] = True
    if extra == "zero_centered_gamma":
        kw["zero_centered_gamma"] = True
    rb = extra == "return_bias"
    kw["return_bias"] = rb
    m = make(kind, mode, dtype, rank, size, **kw)
    if extra == "frozen":
        m.weight.requires_grad_(False)
    k = IN // size if mode == "row" else IN
    lead = (4, 2) if shape3 else (6,)
    torch.manual_seed(100 + rank)
    x = torch.randn(*lead, k, dtype=dtype, requires_grad=extra != "no_input_grad")
    n = OUT // size if mode == "column" else OUT
    rows = lead[0] * size if mode == "column" else lead[0] // size if mode == "row" else lead[0]
    dy = torch.randn(rows, *lead[1:], n, dtype=dtype)
    what = f"{kind} {mode} {norm} bias={bias} {dtype} 3d={shape3} {wgrad} first={first} {extra}"
    fast, took = run(m, x, dy, wgrad, first, rb)
    assert took, f"{what}: the fast path was not taken"
    general(m, True)
    try:
        ref, took = run(m, x, dy, wgrad, first, rb)
    finally:
        general(m, False)
    assert not took, what
    same(fast, ref, what)


def mlp_case(norm, act, bias, dtype, shape3, extra, rank, size):
    """LayerNormMLP (set_parallel_mode, sequence parallel) without userbuffers."""
    kw = dict(normalization=norm, activation=act, bias=bias, return_bias=extra == "return_bias",
              zero_centered_gamma=extra == "zero_centered_gamma")
    if act == "clamped_swiglu":
        kw["activation_params"] = {"limit": 3.0, "alpha": 1.5}
    m = make("mlp", None, dtype, rank, size, **kw)
    if extra == "frozen":
        m.fc1_weight.requires_grad_(False)
        m.fc2_weight.requires_grad_(False)
    if extra == "frozen_biases":  # weight gradients without bias gradients
        m.fc1_bias.requires_grad_(False)
        m.fc2_bias.requires_grad_(False)
    lead = (4, 2) if shape3 else (6,)
    torch.manual_seed(100 + rank)
    x = torch.randn(*lead, IN, dtype=dtype, requires_grad=extra != "no_input_grad")
    dy = torch.randn(*lead, IN, dtype=dtype)
    what = f"mlp {norm} {act} bias={bias} {dtype} 3d={shape3} {extra}"
    fast, took = run(m, x, dy, None, None, kw["return_bias"])
    assert took, f"{what}: the fast path was not taken"
    general(m, True)
    try:
        ref, took = run(m, x, dy, None, None, kw["return_bias"])
    finally:
        general(m, False)
    assert not took, what
    same(fast, ref, what)


MLP_UB_FLAGS = ({"ub_overlap_ag": True, "ub_overlap_rs": True, "ub_overlap_rs_dgrad": True},
                {"ub_overlap_ag": True}, {"ub_overlap_rs": True})


def mlp_ub_case(flags, threshold, switch, dtype, rank, size):
    """LayerNormMLP with ub_* flags, as ub_case: the fast path where every
    overlap falls back (the general path's counts), else the general path."""
    comms = {r: common.comm((64, 64), dtype, name=f"fsp_mlp_{r}", min_chunk_flops=threshold)
             for r in ("fc1_fprop", "fc1_dgrad", "fc2_fprop", "fc2_dgrad")}
    m = make("mlp", None, dtype, rank, size, ub_comm=comms, **flags)
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 2, IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(4, 2, IN, dtype=dtype)
    what = f"ub mlp {flags} threshold={threshold} switch={switch} {dtype}"
    dfast = fast_against_general(m, comms, x, dy, threshold, switch, what)
    overlapped = sum(d[k] for d in dfast.values() for k in ("ag_overlap", "rs_overlap"))
    fallbacks = sum(v for d in dfast.values() for k, v in d.items() if k.endswith("_fallback"))
    backward_overlaps = flags.get("ub_overlap_ag") or flags.get("ub_overlap_rs_dgrad")
    if threshold > 1e30 and not switch:
        assert fallbacks > 0 and overlapped == 0, dfast
    elif threshold == 0 or backward_overlaps:  # the general path overlapped where it pays (switch: in backward)
        assert overlapped > 0, dfast
    for c in comms.values():
        c.close()


def stats(comms):
    """Each communicator's path counters ("waits" depends on timing)."""
    return {r: {k: v for k, v in c.stats().items() if k != "waits"} for r, c in comms.items()}


def fast_against_general(m, comms, x, dy, threshold, switch, what):
    """One forward + backward of m on the fast path, then on the general
    path, on communicators of min_chunk_flops `threshold` (0 from the
    backward on with `switch`): the fast path must be taken exactly when the
    threshold is huge, and both give the same numbers and communicator
    counts. Returns the counts."""
    res = []
    for use_general in (False, True):
        general(m, use_general)
        for c in comms.values():
            c.min_chunk_flops = threshold
        s0 = stats(comms)
        xx = x.detach().clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = m(xx)
        took = took_fast(y)
        if switch:
            for c in comms.values():
                c.min_chunk_flops = 0.0
        y.backward(dy)
        s1 = stats(comms)
        delta = {r: {k: s1[r][k] - s0[r][k] for k in s1[r]} for r in s1}
        res.append(([y.detach(), xx.grad] + [p.grad for _, p in m.named_parameters()], delta, took))
    general(m, False)
    (fast, dfast, took_f), (gen, dgen, took_g) = res
    assert took_f == (threshold > 1e30), f"{what}: fast path taken {took_f}"
    assert not took_g, what
    same(fast, gen, what)
    assert dfast == dgen, f"{what}: communicator counts {dfast} vs the general path's {dgen}"
    return dfast


def ub_case(kind, mode, norm, flags, threshold, switch, dtype, rank, size):
    """A layer with ub_* flags on communicators of min_chunk_flops
    `threshold` (switched to 0 between forward and backward with `switch`):
    the fast path runs it when every overlap falls back, with the general
    path's numbers and fallback counts; where one overlaps, the general path
    (in backward: its steps)."""
    comms = {r: common.comm((64, 64), dtype, name=f"fsp_{r}", min_chunk_flops=threshold) for r in ("fprop", "dgrad")}
    kw = dict(flags, ub_comm=comms)
    if kind == "lnl":
        kw["normalization"] = norm
    m = make(kind, mode, dtype, rank, size, **kw)
    lead = (4, 2)
    torch.manual_seed(100 + rank)
    x = torch.randn(*lead, IN // size if mode == "row" else IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(lead[0] * size if mode == "column" else lead[0] // size, 2,
                     OUT // size if mode == "column" else OUT, dtype=dtype)
    what = f"ub {kind} {mode} {norm} {flags} threshold={threshold} switch={switch} {dtype}"
    dfast = fast_against_general(m, comms, x, dy, threshold, switch, what)
    if threshold > 1e30 and not switch:
        assert sum(v for d in dfast.values() for k, v in d.items() if k.endswith("_fallback")) > 0, dfast
    for c in comms.values():
        c.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    rank, size, _ = setup(ap.parse_args().device)
    n = 0
    layers = [("linear", "column", None), ("linear", "row", None), ("lnl", "column", "LayerNorm"),
              ("lnl", "column", "RMSNorm"), ("lnl", "row", "LayerNorm"), ("lnl", "row", "RMSNorm"),
              # sequence_parallel without a parallel mode only marks the norm's parameters
              ("linear", None, None), ("lnl", None, "LayerNorm")]
    for (kind, mode, norm), bias, dtype, shape3 in itertools.product(
            layers, (True, False), (torch.float32, torch.bfloat16), (False, True)):
        case(kind, mode, norm, bias, dtype, shape3, None, None, None, rank, size)
        n += 1
    for (kind, mode, norm), wgrad, first in itertools.product(layers, ("fuse", "delay"), (None, True, False)):
        case(kind, mode, norm, True, torch.float32, True, wgrad, first, None, rank, size)
        n += 1
    for (kind, mode, norm), extra in itertools.product(layers, ("return_bias", "frozen", "no_input_grad",
                                                                "zero_centered_gamma")):
        if extra == "zero_centered_gamma" and kind == "linear":
            continue
        case(kind, mode, norm, True, torch.bfloat16, False, None, None, extra, rank, size)
        n += 1
    ub_layers = [("linear", "column", None, {"ub_overlap_ag": True, "ub_overlap_rs_dgrad": True}),
                 ("linear", "column", None, {"ub_overlap_ag": True}),
                 ("linear", "row", None, {"ub_overlap_rs": True, "ub_overlap_ag": True}),
                 ("lnl", "column", "LayerNorm", {"ub_overlap_ag": True, "ub_overlap_rs_dgrad": True}),
                 ("lnl", "column", "RMSNorm", {"ub_overlap_ag": True}),
                 ("lnl", "row", "LayerNorm", {"ub_overlap_rs": True})]
    for (kind, mode, norm, flags), (threshold, switch), dtype in itertools.product(
            ub_layers, ((float("inf"), False), (0.0, False), (float("inf"), True)),
            (torch.float32, torch.bfloat16)):
        ub_case(kind, mode, norm, flags, threshold, switch, dtype, rank, size)
        n += 1
    for norm, act, bias, dtype, shape3 in itertools.product(("LayerNorm", "RMSNorm"), ("gelu", "swiglu"),
                                                            (True, False), (torch.float32, torch.bfloat16),
                                                            (False, True)):
        mlp_case(norm, act, bias, dtype, shape3, None, rank, size)
        n += 1
    for extra in ("return_bias", "frozen", "frozen_biases", "no_input_grad", "zero_centered_gamma"):
        mlp_case("LayerNorm", "gelu", True, torch.bfloat16, True, extra, rank, size)
        n += 1
    for act in ("relu", "clamped_swiglu"):
        mlp_case("RMSNorm", act, True, torch.float32, False, None, rank, size)
        n += 1
    for flags, (threshold, switch), dtype in itertools.product(
            MLP_UB_FLAGS, ((float("inf"), False), (0.0, False), (float("inf"), True)),
            (torch.float32, torch.bfloat16)):
        mlp_ub_case(flags, threshold, switch, dtype, rank, size)
        n += 1
    # off the fast path: bulk overlaps (they always run), and tensor parallelism without sequence parallelism
    comms = {r: common.comm((64, 64), torch.float32, name=f"fsp_bulk_{r}") for r in ("fc1_dgrad", "fc1_wgrad")}
    for kw in (dict(ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_comm=comms), dict(sequence_parallel=False)):
        torch.manual_seed(7)
        m = tec.LayerNormMLP(IN, FFN, set_parallel_mode=True, tp_size=size, **dict(dict(sequence_parallel=True), **kw))
        y = m(torch.randn(4, IN, requires_grad=True))
        assert not took_fast(y) and m._plan is False, f"LayerNormMLP {sorted(kw)} took the fast path"
        y.sum().backward()
    for c in comms.values():
        c.close()
    # a sequence the row layer cannot split takes the general path, with its error
    m = make("linear", "row", torch.float32, rank, size)
    try:
        m(torch.randn(size + 1, IN // size))
    except ValueError as e:
        assert "not divisible by the tensor-parallel size" in str(e), e
    else:
        raise AssertionError("an indivisible sequence was accepted")
    print(f"rank {rank}: {n} cases equal", flush=True)
    if rank == 0:
        print("PASS run_fast_sp", flush=True)


MAKE_PLAN = _fast.make_plan

if __name__ == "__main__":
    main()
