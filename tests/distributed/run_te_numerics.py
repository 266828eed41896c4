"""Case-by-case mirror of TransformerEngine 2.x's distributed numerics tests for
Linear and LayerNormLinear (tests/pytorch/distributed/run_numerics.py:
test_linear, test_layernorm_linear), written for this package: a single-node
layer (tp_size=1) against its tensor-parallel twin holding the same parameters,
for every kwargs case x parallel mode x sequence parallelism, with TE's
per-dtype tolerances and TE's worst-element comparison.

Stronger than TE's file: every rank gets different data; biases and norm
parameters are made non-trivial; the input grad and every parameter grad are
checked in every case (sequence-parallel ones after
te.allreduce_sequence_parallel_grads, as Megatron's finalize_model_grads does),
both layers' backward fed the same upstream gradient (TE feeds each the
gradient of a loss on its own output, which in fp16 fails by chance);
plus bf16, torch.autocast, save_original_input, RMSNorm, zero-centred gamma,
the gathered norm output and row-parallel LayerNormLinear (against a reference
that normalises each rank's feature slice, as TE's row LayerNormLinear does).

  torchrun --nproc_per_node=2 tests/distributed/run_te_numerics.py [--device cuda] [--only SUBSTR]
Prints "ok <case>" per case and "PASS run_te_numerics" when every case passed."""
import argparse
import contextlib
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: reference.py
import transformer_engine_c as te  # noqa: E402
import common  # noqa: E402
from common import compare  # noqa: E402
from reference import norm as ref_norm  # noqa: E402

SEQ_LEN, BATCH_SIZE, HIDDEN_SIZE = 16, 16, 64  # TE's shapes
LOSS_FN = torch.nn.MSELoss()
RANK = WORLD = GROUP = None


def tolerances(dtype):
    """TE's _get_tolerances for unquantized runs."""
    return {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 4e-5)}[dtype]


def local(t, dim):
    """This rank's chunk of a full tensor along dim (None: the whole tensor)."""
    return t if dim is None else t.chunk(WORLD, dim)[RANK]


def shard_dim(dist_shape, full_shape):
    diff = [d for d, (a, b) in enumerate(zip(dist_shape, full_shape)) if a != b]
    assert len(dist_shape) == len(full_shape) and len(diff) <= 1, (dist_shape, full_shape)
    if diff:
        assert dist_shape[diff[0]] * WORLD == full_shape[diff[0]], (dist_shape, full_shape)
    return diff[0] if diff else None


class RowLayerNormLinearReference(torch.nn.Module):
    """What a row-parallel LayerNormLinear computes over the full input: each
    rank's feature slice normalised on its own (with its slice of the norm
    parameters), projected, summed over ranks, plus the bias once."""

    def __init__(self, in_features, out_features, dtype, normalization="LayerNorm", eps=1e-5, bias=True):
        super().__init__()
        kw = dict(dtype=dtype, device=common.DEV)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, **kw))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(in_features, **kw))
                                if normalization == "LayerNorm" else None)
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, **kw) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        self.normalization, self.eps = normalization, eps

    def forward(self, x):
        g = self.layer_norm_weight.chunk(WORLD)
        b = self.layer_norm_bias.chunk(WORLD) if self.layer_norm_bias is not None else [None] * WORLD
        parts = [F.linear(ref_norm(xr, gr, br, self.eps, self.normalization, False), wr)
                 for xr, gr, br, wr in zip(x.chunk(WORLD, -1), g, b, self.weight.chunk(WORLD, 1))]
        y = torch.stack(parts).sum(0)
        return y + self.bias if self.bias is not None else y


def constant_init(t):
    return torch.nn.init.constant_(t, 0.5)


def run_case(kind, mode, sp, kwargs, autocast_dtype=None):
    """One case of TE's _test_linear / _test_layernorm_linear. Returns a list of errors."""
    torch.manual_seed(12345)  # as TE: same single-node parameters on every rank
    kwargs = dict(kwargs)
    dtype = kwargs.get("params_dtype", torch.float32)
    errors = []
    if kind == "LayerNormLinear" and mode == "row":
        single = RowLayerNormLinearReference(HIDDEN_SIZE, HIDDEN_SIZE, dtype, kwargs.get("normalization", "LayerNorm"),
                                             bias=kwargs.get("bias", True))
    else:
        single = getattr(te, kind)(HIDDEN_SIZE, HIDDEN_SIZE, device=common.DEV, **kwargs)
    # (TE's test leaves device to its default, CUDA; ours is explicit so that the CPU run works on a GPU host)
    distributed = getattr(te, kind)(HIDDEN_SIZE, HIDDEN_SIZE, tp_size=WORLD, tp_group=GROUP, parallel_mode=mode,
                                    sequence_parallel=sp, device=common.DEV, **kwargs)
    if kwargs.get("init_method") is constant_init:
        for m, what in ((single, "single-node"), (distributed, "distributed")):
            if not bool((m.weight == 0.5).all()):
                errors.append(f"init_method was not applied to the {what} weight")
    sp_params = {n for n, p in distributed.named_parameters() if getattr(p, "sequence_parallel", False)}
    want_sp = set()
    if sp:
        want_sp = {n for n in ("layer_norm_weight", "layer_norm_bias") if mode == "column" and hasattr(distributed, n)
                   and getattr(distributed, n) is not None}
        if mode == "row" and kwargs.get("bias", True):
            want_sp.add("bias")
    if sp_params != want_sp:
        errors.append(f"parameters marked sequence_parallel: {sorted(sp_params)}, expected {sorted(want_sp)}")

    # Non-trivial biases and norm parameters, then copy them (sliced) into the TP layer.
    g = torch.Generator(common.DEV).manual_seed(777)
    with torch.no_grad():
        for name, p in single.named_parameters():
            if p.dim() == 1:
                p.add_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
        full = dict(single.named_parameters())
        for name, p in distributed.named_parameters():
            if name not in full:
                errors.append(f"the distributed layer has a parameter {name!r} the single-node one lacks")
                continue
            p.copy_(local(full[name], shard_dim(p.shape, full[name].shape)))
    if kwargs.get("fuse_wgrad_accumulation"):
        for m in (single, distributed):  # TE's _alloc_main_grad
            for p in m.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)

    # Inputs: the full one on every rank, each rank's part (different per rank).
    rows = SEQ_LEN if kind == "LayerNormLinear" else BATCH_SIZE
    if mode == "column" and sp:
        rows *= WORLD
    x_full = (torch.randn(rows, HIDDEN_SIZE, generator=g)).to(dtype)
    x_dim = -1 if mode == "row" else (0 if sp else None)
    x_single = x_full.clone().requires_grad_()
    x_dist = local(x_full, x_dim).clone().requires_grad_()
    ctx = (lambda: torch.autocast(common.DEV.type, dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
    with ctx():
        with te.fp8_autocast(enabled=False, fp8_recipe=te.fp8.get_default_fp8_recipe()):
            out_s = single(x_single)
        with te.fp8_autocast(enabled=False, fp8_recipe=te.fp8.get_default_fp8_recipe(), fp8_group=GROUP):
            out_d = distributed(x_dist)
    rtol, atol = tolerances(autocast_dtype or dtype)
    y_dim = -1 if mode == "column" else (0 if sp else None)

    def check(name, test, ref):
        e = compare(name, test, ref, rtol, atol)
        if e:
            errors.append(e)

    if kwargs.get("return_layernorm_output"):
        (out_s, norm_s), (out_d, norm_d) = out_s, out_d
        n_dim = None if (kwargs.get("return_layernorm_output_gathered") or not sp) else 0
        check("layernorm output", norm_d, local(norm_s, n_dim))
    if kwargs.get("return_bias"):
        (out_s, bias_s), (out_d, bias_d) = out_s, out_d
        check("returned bias", bias_d, local(bias_s, 0 if mode == "column" else None))
    check("output", out_d, local(out_s, y_dim))

    # MSE loss on the single-node output; the TP layer gets its part of that
    # gradient. (TE's file takes each model's loss on its own output: in fp16
    # the outputs' last-bit differences, through the loss's (out - target),
    # then reach the weight gradients amplified where out is close to target,
    # and a few draws in a hundred fail rtol 1e-3 whatever the layers do
    # (scripts/experiments/fp16_loss_rounding.py). With one
    # upstream gradient the gradient checks measure the backward alone.)
    target = torch.randn(out_s.shape, generator=g).to(out_s.dtype)
    out_s.retain_grad()
    LOSS_FN(out_s, target).backward()
    out_d.backward(local(out_s.grad, y_dim))
    if kwargs.get("delay_wgrad_compute"):
        for m, what in ((single, "single-node"), (distributed, "distributed")):
            if m.weight.grad is not None:
                errors.append(f"delay_wgrad_compute: the {what} weight grad exists before backward_dw()")
        single.backward_dw()
        distributed.backward_dw()
    if sp:
        te.allreduce_sequence_parallel_grads(distributed)

    check("input grad", x_dist.grad, local(x_single.grad, x_dim))
    for name, ps in single.named_parameters():
        pd = getattr(distributed, name)
        d = shard_dim(pd.shape, ps.shape)
        if kwargs.get("fuse_wgrad_accumulation"):
            check(f"{name}.main_grad", pd.main_grad, local(ps.main_grad, d))
        if kwargs.get("fuse_wgrad_accumulation") and name == "weight":
            for m, what in ((single, "single-node"), (distributed, "distributed")):
                if m.weight.grad is not None:
                    errors.append(f"fuse_wgrad_accumulation without grad_added_to_main_grad: the {what} "
                                  "weight.grad is set (TE leaves it None)")
            continue
        if (ps.grad is None) != (pd.grad is None):
            errors.append(f"{name}.grad: {'None' if pd.grad is None else 'set'} in the TP layer, "
                          f"{'None' if ps.grad is None else 'set'} in the single-node one")
        elif ps.grad is not None:
            tol = tolerances(autocast_dtype or ps.grad.dtype)
            e = compare(f"{name}.grad", pd.grad, local(ps.grad, d), *tol)
            if e:
                errors.append(e)
    return errors


LINEAR_KWARGS = [  # TE's test_linear list, then ours
    {}, {"bias": False}, {"init_method": constant_init}, {"fuse_wgrad_accumulation": True}, {"return_bias": True},
    {"params_dtype": torch.float16}, {"delay_wgrad_compute": True},
    {"params_dtype": torch.bfloat16}, {"save_original_input": True},
    {"delay_wgrad_compute": True, "fuse_wgrad_accumulation": True},
]
LAYERNORM_LINEAR_KWARGS = [  # TE's test_layernorm_linear list, then ours
    {}, {"bias": False}, {"init_method": constant_init}, {"fuse_wgrad_accumulation": True}, {"return_bias": True},
    {"params_dtype": torch.float16}, {"zero_centered_gamma": False}, {"return_layernorm_output": True},
    {"delay_wgrad_compute": True},
    {"params_dtype": torch.bfloat16}, {"normalization": "RMSNorm"}, {"zero_centered_gamma": True},
    {"return_layernorm_output": True, "return_layernorm_output_gathered": True},
]


def cases():
    for kw in LINEAR_KWARGS:
        for mode in ("column", "row"):
            for sp in (False, True):
                yield "Linear", mode, sp, kw, None
    for kw in LAYERNORM_LINEAR_KWARGS:
        for sp in (False, True):
            yield "LayerNormLinear", "column", sp, kw, None
    for kw in ({}, {"normalization": "RMSNorm"}, {"bias": False}):
        for sp in (False, True):
            yield "LayerNormLinear", "row", sp, kw, None
    for kind, modes in (("Linear", ("column", "row")), ("LayerNormLinear", ("column",))):
        for mode in modes:
            for sp in (False, True):  # fp32 parameters under torch.autocast(bf16)
                yield kind, mode, sp, {}, torch.bfloat16


def label(kind, mode, sp, kw, ac):
    kws = ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in kw.items()) or "defaults"
    return f"{kind} {mode} sp={sp} {kws}" + (f" autocast={ac}" if ac else "")


def main():
    global RANK, WORLD, GROUP
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--only", default=None, help="run only the cases whose label contains this")
    args = p.parse_args()
    RANK, WORLD, _ = common.setup(args.device)
    GROUP = dist.new_group(list(range(WORLD)))  # as TE: a group of its own, not the default one
    if args.device == "cpu":
        torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    failed, n = [], 0
    for case in cases():
        name = label(*case)
        if args.only and args.only not in name:
            continue
        try:
            errors = run_case(*case)
        except Exception as e:  # noqa: BLE001  (every case runs; the summary says which failed)
            errors = [f"raised {type(e).__name__}: {e}"]
            if RANK == 0:
                traceback.print_exc()
        flag = torch.tensor([1 if errors else 0], dtype=torch.int32)
        dist.all_reduce(flag, dist.ReduceOp.MAX, group=GROUP)
        n += 1
        if errors:
            print(f"FAIL [rank{RANK}] {name}: " + " | ".join(errors), flush=True)
        if flag.item():
            failed.append(name)
        elif RANK == 0:
            print(f"ok {name}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if RANK == 0:
        if failed:
            print(f"{len(failed)} of {n} cases failed:\n  " + "\n  ".join(failed), flush=True)
        else:
            print(f"PASS run_te_numerics ({n} cases, tp={WORLD}, {args.device})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
