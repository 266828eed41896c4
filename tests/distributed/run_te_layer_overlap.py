"""Case-by-case mirror of TransformerEngine 2.x's BF16 layer-overlap tests for
Linear and LayerNormLinear (tests/pytorch/distributed/run_layer_with_overlap.py
as launched by test_comm_gemm_overlap.py's test_layers_with_overlap_bf16),
written for this package: a layer built with TE's ub_* arguments on
communicators from te.module.base.initialize_ub (no tp_group given: tensor-
parallel domains of consecutive ranks, as TE forms them, --tp may be smaller
than the world) against the same layer without overlap, fp32 parameters under
torch.autocast(bf16), loss = output.sum(); output, input grad and every
parameter grad compared with TE's rtol 0.025 / atol 0.00125 (TE's worst-element
rule). Stronger than TE's: every rank gets different inputs, biases and norm
parameters are non-trivial, norm grads are compared too, and the
communicators' stats() must show the overlapped paths ran (no fallback).

  torchrun --nproc_per_node=2 tests/distributed/run_te_layer_overlap.py --layer-type Linear \
      --linear-parallel-mode column [--overlap-rs-dgrad] [--tp 2] [--device cuda]
  torchrun --nproc_per_node=4 tests/distributed/run_te_layer_overlap.py --all --tp 2
With --fp8 delayed|current, TE's test_layers_with_overlap_fp8 instead: the
FP8 communicators (quantization_modes=[FP8]), both layers inside
fp8_autocast with the recipe over the tensor-parallel group, TE's FP8
tolerances (rtol 0.125 / atol 0.0625), and the same stats() checks (the FP8
overlaps ran).
Prints "ok <case>" per case and "PASS run_te_layer_overlap" when all passed."""
import argparse
import sys
import warnings

import torch
import torch.distributed as dist

import transformer_engine_c as te
import common
from common import FP8_TOL, compare, fp8_partials_atol

UB_NAMES = [f"{layer}_{kind}" for layer in ("qkv", "proj", "fc1", "fc2") for kind in ("fprop", "dgrad", "wgrad")]
COUNTERS = ("ag_overlap", "rs_overlap", "bulk_ag", "bulk_rs", "ag_fallback", "rs_fallback")
# TE's six BF16 Linear/LayerNormLinear cases (fp32 parameters), then two with bf16 parameters.
ALL_CASES = [("Linear", "row", False, False), ("Linear", "column", False, False), ("Linear", "column", True, False),
             ("LayerNormLinear", "row", False, False), ("LayerNormLinear", "column", False, False),
             ("LayerNormLinear", "column", True, False),
             ("Linear", "row", False, True), ("LayerNormLinear", "column", False, True)]


FP8_RECIPES = {"delayed": te.recipe.DelayedScaling, "current": te.recipe.Float8CurrentScaling}
def layer_args(opts, tp_group, tp, reference):
    """TE's _get_layer_args for Linear / LayerNormLinear."""
    hidden = opts.num_heads * opts.head_dim
    ffn, qkv = 4 * hidden, 3 * hidden
    shape = [opts.seq_length, opts.batch_size, hidden]
    kwargs = dict(params_dtype=torch.bfloat16 if opts.use_bf16_params else torch.float32, device=common.DEV,
                  tp_group=tp_group, tp_size=tp, sequence_parallel=True,
                  ub_overlap_ag=not reference, ub_overlap_rs=not reference, parallel_mode=opts.linear_parallel_mode)
    if opts.linear_parallel_mode == "row":
        shape[-1] = ffn // tp
        args = [ffn, hidden]
        kwargs["ub_name"] = "proj" if opts.layer_type == "Linear" else "fc2"
    else:
        shape[0] = opts.seq_length // tp
        args = [hidden, qkv]
        kwargs["ub_name"] = "qkv"
        kwargs["ub_overlap_rs_dgrad"] = opts.overlap_rs_dgrad and not reference
        kwargs["ub_bulk_dgrad"] = not opts.overlap_rs_dgrad and not reference
        kwargs["ub_bulk_wgrad"] = not opts.overlap_rs_dgrad and not reference
    return args, kwargs, shape


def build(opts, args, kwargs, errors, what):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with te.fp8_model_init(enabled=False):
            layer = getattr(te, opts.layer_type)(*args, **kwargs)
    n = sum(issubclass(w.category, UserWarning) for w in caught)
    if n > 1:
        errors.append(f"{what}: {n} warnings at construction (TE's inapplicable ub_* flags: at most one): "
                      + "; ".join(str(w.message) for w in caught))
    return layer


def stats(use_fp8=False):
    out = {}
    for name in UB_NAMES:
        try:
            c = te.module.base.get_ub(name, use_fp8)
        except KeyError:
            continue
        out[name] = dict(c.stats())
    return out


def expected_paths(opts):
    """Counters that must grow, summed over the layer's communicators."""
    if opts.linear_parallel_mode == "row":
        return ("rs_overlap", "ag_overlap")  # GEMM+RS in fprop, AG+GEMM of grad_output in dgrad
    return ("ag_overlap", "rs_overlap") if opts.overlap_rs_dgrad else ("ag_overlap", "bulk_ag", "bulk_rs")


def run_case(opts, tp_group, tp, rank):
    errors = []
    ub_cfgs = {}
    if opts.overlap_rs_dgrad:
        ub_cfgs = {"qkv_dgrad": {"method": "ring_exchange"}, "fc1_dgrad": {"method": "ring_exchange"}}
    if opts.fp8_buf:  # the row layers' forward reduce-scatters send FP8 partials
        ub_cfgs.update({n: {"method": "pipeline", "fp8_buf": True} for n in ("proj_fprop", "fc2_fprop")})
    mode = te.module.base.UserBufferQuantizationMode
    te.module.base.initialize_ub([opts.seq_length * opts.batch_size, opts.num_heads * opts.head_dim], tp,
                                 quantization_modes=[mode.FP8 if opts.fp8 else mode.NONE],
                                 dtype=torch.bfloat16, bootstrap_backend=opts.bootstrap_backend, ub_cfgs=ub_cfgs or None)
    try:
        sizes = {n: getattr(te.module.base.get_ub(n, bool(opts.fp8)), "tp_size", tp) for n in ("qkv_fprop", "proj_fprop")}
        if any(s != tp for s in sizes.values()):
            errors.append(f"initialize_ub(tp_size={tp}) made communicators of sizes {sizes}")
        torch.manual_seed(opts.seed)  # as TE: the same parameters on every rank
        args, kwargs, shape = layer_args(opts, tp_group, tp, reference=False)
        test_model = build(opts, args, kwargs, errors, "test layer")
        ref_args, ref_kwargs, _ = layer_args(opts, tp_group, tp, reference=True)
        ref_model = build(opts, ref_args, ref_kwargs, errors, "reference layer")
        g = torch.Generator(common.DEV).manual_seed(opts.seed + 1)
        with torch.no_grad():
            for (name, tp_), (_, rp) in zip(test_model.named_parameters(), ref_model.named_parameters()):
                if tp_.dim() == 1:  # non-trivial biases and norm parameters
                    tp_.add_((torch.randn(tp_.shape, generator=g) * 0.2).to(tp_.dtype))
                rp.copy_(tp_)
        # different inputs on every rank (TE's are equal on all ranks)
        gx = torch.Generator(common.DEV).manual_seed(opts.seed + 1000 + rank)
        x = torch.randn(shape, generator=gx, dtype=torch.float32)
        before = stats(bool(opts.fp8))
        recipe = FP8_RECIPES[opts.fp8]() if opts.fp8 else None
        if opts.fp8_buf and opts.fp8 == "delayed":
            # The inputs grow with the step (x * (1 + step)), and an FP8 output is cast with the scale of the
            # earlier steps' amaxes: it saturates where it grew by more than 2**margin (delayed scaling's
            # rule, as in TE). Margin 1 covers steps 1 (2x) and 2 (1.5x the last).
            recipe = te.recipe.DelayedScaling(margin=1)

        def run_fwd_bwd(model, step):
            xi = (x * (1 + step)).requires_grad_(True)
            with torch.autocast(common.DEV.type, dtype=torch.bfloat16):
                with te.fp8_autocast(enabled=bool(opts.fp8), fp8_recipe=recipe, fp8_group=tp_group):
                    y = model(xi)
                out = y[0] if isinstance(y, tuple) else y
                out.sum().backward()
            return [out, xi.grad] + [p.grad for _, p in model.named_parameters()]

        partials = opts.fp8_buf and opts.linear_parallel_mode == "row"
        for step in range(3 if opts.fp8 else 1):  # FP8: the later steps run on the updated scales
            test_t = run_fwd_bwd(test_model, step)
            after = stats(bool(opts.fp8))
            ref_t = run_fwd_bwd(ref_model, step)
            names = ["output", "input.grad"] + [n + ".grad" for n, _ in test_model.named_parameters()]
            if len(test_t) != len(ref_t):
                errors.append(f"{len(test_t)} tensors to compare vs {len(ref_t)} in the reference")
            for name, a, b in zip(names, test_t, ref_t):
                if a is None or b is None:
                    if (a is None) != (b is None):
                        errors.append(f"{name}: None in one layer only")
                    continue
                tol = dict(FP8_TOL) if opts.fp8 else {}
                if partials and name == "output":
                    tol["atol"] = fp8_partials_atol(b)
                e = compare(f"step {step} {name}", a, b, **tol)
                if e:
                    errors.append(e)
        if opts.fp8 == "delayed":  # the overlap's amaxes (local rows, reduced over the group) are the reference's
            for key in ("scaling_fwd", "scaling_bwd"):
                a, b = test_model.fp8_meta[key].scale, ref_model.fp8_meta[key].scale
                if partials and key == "scaling_fwd":  # the output role: the partials' amax, the reference has none
                    if not (a[2] != 1 and b[2] == 1):
                        errors.append(f"the output role's scale is {a[2].item()} (reference {b[2].item()}): the FP8 "
                                      "partials' amax was not recorded")
                    a, b = a[:2], b[:2]
                if not torch.equal(a, b):
                    errors.append(f"{key} scales differ from the reference's: {a.tolist()} vs {b.tolist()}")
        if partials:  # every push carried FP8 bytes and their scale_inv; bf16 ones under current scaling
            name = kwargs["ub_name"] + "_fprop"
            rows, n = opts.seq_length * opts.batch_size // tp, opts.num_heads * opts.head_dim
            chunk = (rows * n + 15) // 16 * 16 + 16 if opts.fp8 == "delayed" else rows * n * 2
            pushes = (after[name]["rs_overlap"] - before[name]["rs_overlap"]) * (tp - 1)
            sent = after[name]["bytes_sent"] - before[name]["bytes_sent"]
            if pushes <= 0 or sent != pushes * chunk:
                errors.append(f"{name} sent {sent} bytes in {pushes} pushes; expected partials of {chunk} bytes")
        grew = {k: sum(after[n][k] - before[n][k] for n in after) for k in COUNTERS}
        for k in expected_paths(opts):
            if grew[k] <= 0:
                errors.append(f"stats(): {k} did not grow (the overlapped path did not run): {grew}")
        for k in ("ag_fallback", "rs_fallback"):
            if grew[k]:
                errors.append(f"stats(): {k} grew by {grew[k]}: the overlap fell back to the plain path")
        if rank == 0:
            print("  stats grew: " + ", ".join(f"{k}={v}" for k, v in grew.items()), flush=True)
    finally:
        te.module.base.destroy_ub()
    return errors


def case_label(opts, tp):
    return (f"{opts.layer_type} {opts.linear_parallel_mode}"
            + (" " + ("DGRAD+RS" if opts.overlap_rs_dgrad else "BULK DGRAD/WGRAD")
               if opts.linear_parallel_mode == "column" else "")
            + (" bf16-params" if opts.use_bf16_params else "") + (f" fp8={opts.fp8}" if opts.fp8 else "")
            + (" fp8_buf" if opts.fp8_buf else "")
            + f" tp={tp}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-l", "--layer-type", choices=["Linear", "LayerNormLinear"], default="Linear")
    p.add_argument("--linear-parallel-mode", choices=["row", "column"], default="row")
    p.add_argument("--overlap-rs-dgrad", action="store_true")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world)")
    p.add_argument("-n", "--num-heads", type=int, default=4)
    p.add_argument("-d", "--head-dim", type=int, default=8)
    p.add_argument("-s", "--seq-length", type=int, default=16, help="the full sequence (split over the TP ranks)")
    p.add_argument("-b", "--batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--use-bf16-params", action="store_true")
    p.add_argument("--bootstrap-backend", choices=["gloo", "mpi", "nccl"], default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--fp8", choices=["delayed", "current"], default=None, help="TE's FP8 overlap cases")
    p.add_argument("--fp8-buf", action="store_true",
                   help="with --fp8: ub_cfgs fp8_buf on proj_fprop and fc2_fprop (FP8 reduce-scatter partials)")
    p.add_argument("--all", action="store_true", help="run TE's six cases (and two with bf16 params)")
    opts = p.parse_args()
    if opts.fp8_buf and not opts.fp8:
        raise SystemExit("--fp8-buf needs --fp8")
    rank, world, _ = common.setup(opts.device)
    if opts.device == "cpu":
        torch.set_num_threads(1)
    if opts.bootstrap_backend is None:
        opts.bootstrap_backend = "nccl" if opts.device == "cuda" else "gloo"
    tp = opts.tp or world
    if world % tp:
        raise SystemExit(f"--tp {tp} does not divide the world size {world}")
    tp_group = None
    for base in range(0, world, tp):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(base, base + tp)))
        if base <= rank < base + tp:
            tp_group = g
    cases = ALL_CASES if opts.all else [(opts.layer_type, opts.linear_parallel_mode, opts.overlap_rs_dgrad,
                                         opts.use_bf16_params)]
    failed = []
    for layer_type, mode, rs_dgrad, bf16_params in cases:
        opts.layer_type, opts.linear_parallel_mode = layer_type, mode
        opts.overlap_rs_dgrad, opts.use_bf16_params = rs_dgrad, bf16_params
        name = case_label(opts, tp)
        try:
            errors = run_case(opts, tp_group, tp, rank)
        except Exception as e:  # noqa: BLE001  (report every case)
            errors = [f"raised {type(e).__name__}: {e}"]
        flag = torch.tensor([1 if errors else 0], dtype=torch.int32)
        dist.all_reduce(flag, dist.ReduceOp.MAX)
        if errors:
            print(f"NUMERICAL CHECK FAILED [rank{rank}] {name}: " + " | ".join(errors), flush=True)
        if flag.item():
            failed.append(name)
        elif rank == 0:
            print(f"ok {name}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"{len(failed)} case(s) failed: {failed}" if failed else f"PASS run_te_layer_overlap ({len(cases)} "
              f"cases, tp={tp} of {world} ranks, {opts.device})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
