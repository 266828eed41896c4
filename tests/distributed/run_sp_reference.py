"""torchrun runner: the layers under sequence parallelism against a float64
reference of the whole (unsharded) layer, on every rank: column and row
Linear, LayerNormLinear (LayerNorm and RMSNorm, column and row, where each
rank normalises its feature slice, as TE's row LayerNormLinear does; without
a parallel mode) and LayerNormMLP (set_parallel_mode; gelu, swiglu, relu,
clamped_swiglu), with and without bias, fp32 and bf16, 2-D and 3-D inputs,
plain, fused (main_grad, TE's first-micro-batch overwrite) and delayed
(backward_dw) weight gradients, return_bias, a frozen weight, an input
without grad, zero_centered_gamma, the no-grad forward; with userbuffers
communicators that fall back at the call's shape, that overlap, and that
switch between forward and backward (their counters say which ran).

Gradients of parameters marked `sequence_parallel` are this rank's partial
sums (TE's semantics): they are summed over the group before the comparison.
Prints "PASS run_sp_reference" on success.

    torchrun --nproc_per_node=2 tests/distributed/run_sp_reference.py [--device cuda]
"""
import argparse
import itertools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
import common  # noqa: E402
from common import close, setup  # noqa: E402
from mlp_reference import act as act_ref  # noqa: E402
from reference import norm as norm_ref  # noqa: E402

IN, OUT = 24, 20
FFN = 40  # LayerNormMLP's


def gathered(t, size):
    """Every rank's t (float64 on the CPU), in rank order."""
    parts = [torch.empty_like(t, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(parts, t.detach().to(torch.float64).contiguous())
    return [p.cpu() for p in parts]


def make(kind, mode, dtype, size, **kw):
    """The layer with non-trivial parameters; the replicated ones equal on every rank."""
    rank = dist.get_rank()
    torch.manual_seed(7 + rank)
    if kind == "mlp":
        kw.setdefault("sequence_parallel", True)
        m = tec.LayerNormMLP(IN, FFN, params_dtype=dtype, set_parallel_mode=True, tp_size=size, **kw)
    elif kind == "linear":
        m = tec.Linear(IN, OUT, params_dtype=dtype, parallel_mode=mode, sequence_parallel=True, tp_size=size, **kw)
    else:
        m = tec.LayerNormLinear(IN, OUT, params_dtype=dtype, parallel_mode=mode, sequence_parallel=True,
                                tp_size=size, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
            if not is_sharded(m, kind, p):
                dist.broadcast(p, 0)
    return m


def parallel(m, kind):
    return m.set_parallel_mode if kind == "mlp" else m.tp.mode is not None


def is_sharded(m, kind, p):
    return parallel(m, kind) and getattr(p, "tensor_model_parallel", False)


def reference_params(m, kind, size):
    """{name: [every rank's shard]} of sharded parameters and {name: [it]}
    of replicated ones, float64 leaves on the CPU that need grad where the
    parameter does."""
    out = {}
    for name, p in m.named_parameters():
        parts = gathered(p, size) if is_sharded(m, kind, p) else [p.detach().double().cpu()]
        out[name] = [t.requires_grad_(p.requires_grad) for t in parts]
    return out


def reference(kind, mode, m, P, x, size, return_bias):
    """The whole layer's output for the whole input x, from the shards P."""
    def one(name, i=0):
        v = P.get(name)
        return None if v is None else v[i if len(v) > 1 else 0]

    b_name = "fc2_bias" if kind == "mlp" else "bias"
    bias = None if return_bias else one(b_name)
    eps = getattr(m, "eps", 1e-5)
    zcg = getattr(m, "zero_centered_gamma", False)
    if kind == "mlp":
        kw = m._act_kw
        n = norm_ref(x, one("layer_norm_weight"), one("layer_norm_bias"), eps, m.normalization, zcg)
        y = sum(F.linear(act_ref(m.activation, F.linear(n, P["fc1_weight"][r], one("fc1_bias", r)), **kw),
                         P["fc2_weight"][r]) for r in range(size))
        return y if bias is None else y + bias
    shards = len(P["weight"])
    if mode == "row":
        xs = x.chunk(shards, -1)
        if kind == "lnl":
            xs = [norm_ref(xs[r], one("layer_norm_weight", r), one("layer_norm_bias", r), eps, m.normalization, zcg)
                  for r in range(shards)]
        y = sum(F.linear(xs[r], P["weight"][r]) for r in range(shards))
        return y if bias is None else y + bias
    if kind == "lnl":
        x = norm_ref(x, one("layer_norm_weight"), one("layer_norm_bias"), eps, m.normalization, zcg)
    return torch.cat([F.linear(x, P["weight"][r], None if return_bias else one("bias", r)) for r in range(shards)],
                     -1)


def layout(kind, mode, m):
    """(dim along which the input's whole is gathered, the output's, the
    output gradient's), None: local."""
    if kind == "mlp":
        return (0, 0, 0) if m.tp.sp else (None, None, None)
    if mode == "column":
        return 0, -1, -1
    if mode == "row":
        return -1, 0, 0
    return 0, 0, 0  # no parallel mode: each rank its own tokens


def whole(t, dim, size):
    return t.detach().double().cpu() if dim is None else torch.cat(gathered(t, size), dim)


def mine(t, dim, rank, size):
    return t if dim is None else t.chunk(size, dim)[rank]


def check(kind, mode, m, x, dy, what, wgrad=None, first=None, return_bias=False, before_backward=None):
    """One forward + backward (and a no-grad forward) of m against the
    float64 reference; before_backward() runs between forward and backward."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if os.environ.get("SPR_VERBOSE"):
        print(f"rank {rank}: {what}", flush=True)
    dtype = x.dtype
    in_dim, out_dim, dy_dim = layout(kind, mode, m)
    if in_dim is None and parallel(m, kind):  # tensor parallel without sequence parallelism: one input
        dist.broadcast(x, 0)
        dist.broadcast(dy, 0)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    m.zero_grad(set_to_none=True)
    wname = "fc2_weight" if kind == "mlp" else "weight"
    w = getattr(m, wname)
    if wgrad == "fuse":
        w.main_grad = torch.full(w.shape, 0.25)
        w.grad_added_to_main_grad = False
        w.zero_out_wgrad = True
    out = m(x, is_first_microbatch=first)
    y = out[0] if return_bias else out
    if before_backward is not None:
        before_backward()
    y.backward(dy)
    if wgrad == "delay":
        m.backward_dw()
    with torch.no_grad():
        o = m(x, is_first_microbatch=first)
        y_nograd = o[0] if return_bias else o

    P = reference_params(m, kind, size)
    xr = whole(x, in_dim, size).requires_grad_(x.requires_grad)
    yr = reference(kind, mode, m, P, xr, size, return_bias)
    yr.backward(whole(dy, dy_dim, size))
    close(y, mine(yr, out_dim, rank, size), f"{what}: output", tensorwise=True)
    close(y_nograd, mine(yr, out_dim, rank, size), f"{what}: no-grad output", tensorwise=True)
    if return_bias:
        b = out[1]
        ref_b = getattr(m, "fc2_bias" if kind == "mlp" else m.bias_names[0])
        assert b.dtype == dtype and torch.equal(b, ref_b.to(dtype)), f"{what}: returned bias"
    if x.requires_grad:
        close(x.grad, mine(xr.grad, in_dim, rank, size), f"{what}: input grad", tensorwise=True)
    else:
        assert x.grad is None
    for name, p in m.named_parameters():
        ref = P[name][rank if len(P[name]) > 1 else 0].grad
        got = p.grad
        if wgrad == "fuse" and p is w:
            assert p.grad_added_to_main_grad is True and torch.count_nonzero(p.grad) == 0, what
            got = p.main_grad - (0.0 if first else 0.25)
        if not p.requires_grad or ref is None:
            assert got is None, f"{what}: {name} got a gradient"
            continue
        # this rank's partial sum (TE's semantics; without a parallel mode every parameter's)
        if getattr(p, "sequence_parallel", False) or not parallel(m, kind):
            got = got.detach().double()
            dist.all_reduce(got)
        close(got, ref, f"{what}: {name} grad", tensorwise=True)


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
    m = make(kind, mode, dtype, size, **kw)
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
    check(kind, mode, m, x, dy, what, wgrad, first, rb)


def mlp_case(norm, act, bias, dtype, shape3, extra, rank, size, **kw):
    """LayerNormMLP (set_parallel_mode, sequence parallel unless kw says)."""
    kw.update(normalization=norm, activation=act, bias=bias, return_bias=extra == "return_bias",
              zero_centered_gamma=extra == "zero_centered_gamma")
    if act == "clamped_swiglu":
        kw["activation_params"] = {"limit": 3.0, "alpha": 1.5}
    m = make("mlp", None, dtype, size, **kw)
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
    what = f"mlp {norm} {act} bias={bias} {dtype} 3d={shape3} {extra} {sorted(kw)}"
    check("mlp", None, m, x, dy, what, return_bias=kw["return_bias"])
    return m


def stats(comms):
    """Each communicator's path counters ("waits" depends on timing)."""
    return {r: {k: v for k, v in c.stats().items() if k != "waits"} for r, c in comms.items()}


def ub_run(kind, mode, m, comms, x, dy, threshold, switch, what):
    """check() on communicators of min_chunk_flops `threshold` (0 from the
    backward on with `switch`). Returns the counters' change."""
    for c in comms.values():
        c.min_chunk_flops = threshold
    s0 = stats(comms)

    def lower():
        for c in comms.values():
            c.min_chunk_flops = 0.0
    check(kind, mode, m, x, dy, what, before_backward=lower if switch else None)
    s1 = stats(comms)
    return {r: {k: s1[r][k] - s0[r][k] for k in s1[r]} for r in s1}


def counts(delta):
    overlapped = sum(d[k] for d in delta.values() for k in ("ag_overlap", "rs_overlap"))
    fallbacks = sum(v for d in delta.values() for k, v in d.items() if k.endswith("_fallback"))
    return overlapped, fallbacks


def ub_case(kind, mode, norm, flags, threshold, switch, dtype, rank, size):
    comms = {r: common.comm((64, 64), dtype, name=f"spr_{r}", min_chunk_flops=threshold) for r in ("fprop", "dgrad")}
    kw = dict(flags, ub_comm=comms)
    if kind == "lnl":
        kw["normalization"] = norm
    m = make(kind, mode, dtype, size, **kw)
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 2, IN // size if mode == "row" else IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(4 * size if mode == "column" else 4 // size, 2, OUT // size if mode == "column" else OUT,
                     dtype=dtype)
    what = f"ub {kind} {mode} {norm} {flags} threshold={threshold} switch={switch} {dtype}"
    overlapped, fallbacks = counts(ub_run(kind, mode, m, comms, x, dy, threshold, switch, what))
    if threshold > 1e30 and not switch:
        assert fallbacks > 0 and overlapped == 0, what
    elif threshold == 0:
        assert overlapped > 0, what
    for c in comms.values():
        c.close()


MLP_UB_FLAGS = ({"ub_overlap_ag": True, "ub_overlap_rs": True, "ub_overlap_rs_dgrad": True},
                {"ub_overlap_ag": True}, {"ub_overlap_rs": True})


def mlp_ub_case(flags, threshold, switch, dtype, rank, size):
    comms = {r: common.comm((64, 64), dtype, name=f"spr_mlp_{r}", min_chunk_flops=threshold)
             for r in ("fc1_fprop", "fc1_dgrad", "fc2_fprop", "fc2_dgrad")}
    m = make("mlp", None, dtype, size, ub_comm=comms, **flags)
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 2, IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(4, 2, IN, dtype=dtype)
    what = f"ub mlp {flags} threshold={threshold} switch={switch} {dtype}"
    overlapped, fallbacks = counts(ub_run("mlp", None, m, comms, x, dy, threshold, switch, what))
    backward_overlaps = flags.get("ub_overlap_ag") or flags.get("ub_overlap_rs_dgrad")
    if threshold > 1e30 and not switch:
        assert fallbacks > 0 and overlapped == 0, what
    elif threshold == 0 or backward_overlaps:
        assert overlapped > 0, what
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
    # the bulk overlaps, and tensor parallelism without sequence parallelism
    comms = {r: common.comm((64, 64), torch.float32, name=f"spr_bulk_{r}") for r in ("fc1_dgrad", "fc1_wgrad")}
    for kw in (dict(ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_comm=comms), dict(sequence_parallel=False)):
        mlp_case("LayerNorm", "gelu", True, torch.float32, False, None, rank, size, **kw)
        n += 1
    for c in comms.values():
        c.close()
    # a sequence the row layer cannot split: the named error
    m = make("linear", "row", torch.float32, size)
    try:
        m(torch.randn(size + 1, IN // size))
    except ValueError as e:
        assert "not divisible by the tensor-parallel size" in str(e), e
    else:
        raise AssertionError("an indivisible sequence was accepted")
    print(f"rank {rank}: {n} cases match the float64 reference", flush=True)
    if rank == 0:
        print("PASS run_sp_reference", flush=True)


if __name__ == "__main__":
    main()
