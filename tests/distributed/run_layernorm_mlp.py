"""torchrun runner: tec.LayerNormMLP with tensor + sequence parallelism
(set_parallel_mode=True) against the float64 reference of the whole
(unsharded) MLP, and against the same module without userbuffers: output,
input grad and every parameter grad (this rank's shards; the norm weights and
fc2's bias, which carry `sequence_parallel`, summed over the group as the
training framework does). Covers every activation and both norms; every
userbuffers flag combination TE allows, through the registry's fc1_* / fc2_*
communicators, in every grad mode (training step, no_grad, inference_mode,
reentrant and non-reentrant checkpointing, checkpoint=True), each overlapped
path proven by the communicators' stats(); nothing saved for backward
aliases a buffer (tec.debug.check_saved_tensors around everything);
return_layernorm_output (this rank's rows, or gathered); bfloat16 (TE's
tolerance, whole tensor); and DistributedWeight for both weights. Prints
"PASS run_layernorm_mlp".

    torchrun --nproc_per_node=2 tests/distributed/run_layernorm_mlp.py [--device cuda]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: mlp_reference
import transformer_engine_c as tec  # noqa: E402
from common import FP8_TOL, close, compare, fp8_partials_atol, init_ub, rel_err, setup  # noqa: E402
from mlp_reference import fc1_global, layernorm_mlp  # noqa: E402

SEQ, B, H, FFN = 4, 2, 32, 64  # SEQ: sequence positions per rank
ACTS = sorted(tec._engine.ACTIVATIONS)
UB_COMBOS = [
    {}, dict(ub_overlap_ag=True), dict(ub_overlap_rs=True), dict(ub_overlap_rs_dgrad=True),
    dict(ub_bulk_dgrad=True), dict(ub_bulk_wgrad=True), dict(ub_bulk_dgrad=True, ub_bulk_wgrad=True),
    dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True),
    dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True),
]
# flag -> the (communicator, counter) runs of one forward + backward
FWD = {"ub_overlap_ag": [("fc1_fprop", "ag_overlap")], "ub_overlap_rs": [("fc2_fprop", "rs_overlap")]}
BWD = {"ub_overlap_ag": [("fc2_dgrad", "ag_overlap")], "ub_overlap_rs_dgrad": [("fc1_dgrad", "rs_overlap")],
       "ub_bulk_dgrad": [("fc1_dgrad", "bulk_ag")], "ub_bulk_wgrad": [("fc1_wgrad", "bulk_rs")]}
GRAD_MODES = ["train", "no_grad", "inference_mode", "ckpt_reentrant", "ckpt", "checkpoint_arg"]


def counts(use_fp8=False):
    return {(n, k): v for n in ("fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad")
            for k, v in tec.get_ub(n, use_fp8).stats().items()}


def expected(flags, mode):
    """{(comm, counter): runs} of one call in grad mode `mode`."""
    want = {}
    fwd_runs = {"train": 1, "no_grad": 1, "inference_mode": 1, "ckpt_reentrant": 2, "ckpt": 2,
                "checkpoint_arg": 1}[mode]
    for flag, on in flags.items():
        for key in FWD.get(flag, []):
            n = fwd_runs + (1 if (mode == "checkpoint_arg" and key[0] == "fc1_fprop") else 0)
            want[key] = want.get(key, 0) + n
        if mode in ("no_grad", "inference_mode"):
            continue
        if flag in ("ub_bulk_dgrad", "ub_bulk_wgrad") and flags.get("ub_overlap_rs_dgrad"):
            continue
        for key in BWD.get(flag, []):
            want[key] = want.get(key, 0) + 1
    return want


def gather_params(m, tp, rank, gated):
    """The unsharded float64 parameters (TE's tp_size=1 layout) from every rank's shards."""
    full = {}
    for n, p in m.named_parameters():
        t = p.detach().double().cpu()
        if n in ("fc1_weight", "fc1_bias", "fc2_weight"):
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous())
            parts = [q.double().cpu() for q in parts]
            t = fc1_global(parts, gated) if n.startswith("fc1") else torch.cat(parts, dim=1)
        full[n] = t.requires_grad_()
    return full


def my_shard(n, g, tp, rank, gated):
    """This rank's part of the reference's full gradient of parameter n."""
    if n == "fc2_weight":
        return g.chunk(tp, dim=1)[rank]
    if n.startswith("fc1"):
        if not gated:
            return g.chunk(tp, dim=0)[rank]
        a, gate = g.chunk(2, dim=0)
        return torch.cat([a.chunk(tp, dim=0)[rank], gate.chunk(tp, dim=0)[rank]])
    return g


def run_mode(m, x, mode):
    if mode == "no_grad":
        with torch.no_grad():
            return m(x)
    if mode == "inference_mode":
        with torch.inference_mode():
            return m(x)
    if mode.startswith("ckpt"):
        return tec.checkpoint(m, x, use_reentrant=mode == "ckpt_reentrant")
    return m(x)


def check_case(activation, normalization, flags, mode, tp, rank, dev, dtype=torch.float32, extra=None):
    kw = dict(activation=activation, normalization=normalization, set_parallel_mode=True, sequence_parallel=True,
              tp_group=dist.group.WORLD, tp_size=tp, params_dtype=dtype, device=dev,
              checkpoint=mode == "checkpoint_arg", **(extra or {}))
    ret_ln = bool(kw.get("return_layernorm_output"))
    gathered = ret_ln and bool(kw.get("return_layernorm_output_gathered"))
    if activation == "clamped_swiglu":
        kw["activation_params"] = {"limit": 1.0, "alpha": 1.5}
    torch.manual_seed(7)  # the same replicated parameters on every rank, rank-specific shards
    m = tec.LayerNormMLP(H, FFN, **flags, **kw)
    plain = tec.LayerNormMLP(H, FFN, **kw)
    with torch.no_grad():
        for i, (n, p) in enumerate(m.named_parameters()):
            shared = torch.Generator().manual_seed(i)
            own = torch.Generator().manual_seed(i + 17 * (rank + 1))
            gen = own if n in ("fc1_weight", "fc1_bias", "fc2_weight") else shared
            v = torch.randn(p.shape, generator=gen, dtype=torch.float64, device="cpu") * 0.3
            p.copy_((v + (1.0 if n == "layer_norm_weight" else 0.0)).to(dtype))
    plain.load_state_dict(m.state_dict())
    gated = activation in tec._engine.GATED_ACTIVATIONS
    p64 = gather_params(m, tp, rank, gated)

    g = torch.Generator().manual_seed(1000)
    x_full = torch.randn(SEQ * tp, B, H, generator=g, dtype=torch.float64, device="cpu")
    dy_full = torch.randn(SEQ * tp, B, H, generator=g, dtype=torch.float64, device="cpu")
    dln_full = torch.randn(SEQ * tp, B, H, generator=g, dtype=torch.float64, device="cpu")
    x_loc = x_full.chunk(tp, 0)[rank].to(dtype).to(dev)
    dy_loc = dy_full.chunk(tp, 0)[rank].to(dtype).to(dev)
    x64 = x_full.clone().requires_grad_()
    act_kw = kw.get("activation_params")
    y64, n64 = layernorm_mlp(x64, p64, activation=activation, normalization=normalization, act_kw=act_kw)
    # the returned normalised input's gradient: the whole sequence's when gathered, else this rank's rows
    dln_mine = dln_full if gathered else dln_full.chunk(tp, 0)[rank]
    loss64 = (y64 * dy_full).sum()
    if ret_ln:  # summed over ranks: each rank's rows once, or every rank's copy of the whole sequence
        loss64 = loss64 + (n64 * dln_full).sum() * (tp if gathered else 1)
    loss64.backward()
    label = (f"{activation} {normalization} {'+'.join(sorted(flags)) or 'no-ub'} {mode} tp={tp}"
             f"{' ' + str(dtype).split('.')[1] if dtype != torch.float32 else ''}"
             f"{' return_ln' + ('_gathered' if gathered else '') if ret_ln else ''}")

    before = counts()
    xi = x_loc.clone().requires_grad_(mode not in ("no_grad", "inference_mode"))
    out = run_mode(m, xi, mode)
    y, ln = out if ret_ln else (out, None)
    if xi.requires_grad:
        loss = (y * dy_loc).sum()
        if ret_ln:
            loss = loss + (ln * dln_mine.to(dtype).to(dev)).sum()
        loss.backward()
    after = counts()
    for key, n in expected(flags, mode).items():
        ran = after[key] - before[key]
        assert ran == n, f"{label}: {key[0]}.{key[1]} moved by {ran}, expected {n}"

    tensorwise = dtype != torch.float32
    close(y, y64.chunk(tp, 0)[rank].float(), f"{label}: output", tensorwise)
    if ret_ln:
        want = n64 if gathered else n64.chunk(tp, 0)[rank]
        close(ln, want.float(), f"{label}: returned normalised input", tensorwise)
    if not xi.requires_grad:
        with torch.no_grad():
            yp = plain(x_loc)
            close(y, yp[0] if ret_ln else yp, f"{label}: output vs the module without userbuffers", tensorwise)
        return label
    xp = x_loc.clone().requires_grad_()
    outp = plain(xp)
    loss = (outp[0] * dy_loc).sum() + (outp[1] * dln_mine.to(dtype).to(dev)).sum() if ret_ln else (outp * dy_loc).sum()
    loss.backward()
    close(xi.grad, x64.grad.chunk(tp, 0)[rank].float(), f"{label}: input grad", tensorwise)
    close(xi.grad, xp.grad, f"{label}: input grad vs without userbuffers", tensorwise)
    for (n, p), (_, pp) in zip(m.named_parameters(), plain.named_parameters()):
        grad, pgrad = p.grad.clone(), pp.grad.clone()
        if getattr(p, "sequence_parallel", False):  # the framework's reduction (Megatron's)
            dist.all_reduce(grad)
            dist.all_reduce(pgrad)
        close(grad, my_shard(n, p64[n].grad, tp, rank, gated).float(), f"{label}: grad of {n}", tensorwise)
        close(grad, pgrad, f"{label}: grad of {n} vs without userbuffers", tensorwise)
    return label


def check_distributed_weight(dev, world, rank):
    """Both weights as DistributedWeight sharded over the group (tp=1, data
    parallel): same results as plain weights, and backward gathers each
    weight again (it got the original objects back)."""
    labels = []
    for checkpoint in (False, True):
        torch.manual_seed(3)
        kw = dict(activation="swiglu", device=dev, checkpoint=checkpoint)
        ref = tec.LayerNormMLP(H, FFN, **kw)
        m = tec.LayerNormMLP(H, FFN, **kw)
        m.load_state_dict(ref.state_dict())
        for n in ("fc1_weight", "fc2_weight"):
            full = getattr(ref, n).detach()
            rows = full.shape[0] // world
            setattr(m, n, tec.DistributedWeight(full[rank * rows:(rank + 1) * rows].clone(), full.shape,
                                                group=dist.group.WORLD))
        x = torch.randn(SEQ, B, H, generator=torch.Generator().manual_seed(50 + rank), device="cpu").to(dev)
        dy = torch.randn(SEQ, B, H, generator=torch.Generator().manual_seed(60 + rank), device="cpu").to(dev)
        xr = x.clone().requires_grad_()
        ref(xr).backward(dy)
        xi = x.clone().requires_grad_()
        gathers = {n: getattr(m, n).gather_count for n in ("fc1_weight", "fc2_weight")}
        m(xi).backward(dy)
        for n in ("fc1_weight", "fc2_weight"):
            ran = getattr(m, n).gather_count - gathers[n]
            assert ran == 2, f"DistributedWeight {n} checkpoint={checkpoint}: gathered {ran} times, expected 2"
            wg = getattr(ref, n).grad.clone()
            dist.all_reduce(wg)
            rows = wg.shape[0] // world
            assert rel_err(getattr(m, n).grad, wg[rank * rows:(rank + 1) * rows]) < 1e-5, n
        assert rel_err(xi.grad, xr.grad) < 1e-5
        labels.append(f"DistributedWeight checkpoint={checkpoint}")
    return labels


def check_case_fp8(activation, normalization, flags, mode, tp, rank, dev, recipe_name, fp8_buf=False):
    """FP8 (the recipe over the group, two steps where backward runs): the
    module with userbuffers (FP8 all-gathers through the FP8 communicators)
    against the same module without them, in float32 (the FP8 products are
    the same; only the reduce-scatters' summation order differs: relative
    error <= 1e-5), the overlapped paths proven by the FP8 communicators'
    stats(). fp8_buf: in bf16, fc2's reduce-scatter sending FP8 partials
    (each one FP8 rounding: TE's FP8 tolerances), proven by its bytes sent."""
    kw = dict(activation=activation, normalization=normalization, set_parallel_mode=True, sequence_parallel=True,
              tp_group=dist.group.WORLD, tp_size=tp, params_dtype=torch.bfloat16 if fp8_buf else torch.float32,
              device=dev, checkpoint=mode == "checkpoint_arg")
    torch.manual_seed(7)
    m, plain = tec.LayerNormMLP(H, FFN, **flags, **kw), tec.LayerNormMLP(H, FFN, **kw)
    with torch.no_grad():
        for i, (n, p) in enumerate(m.named_parameters()):
            gen = torch.Generator().manual_seed(i + (17 * (rank + 1) if n in ("fc1_weight", "fc1_bias", "fc2_weight")
                                                    else 0))
            p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.3 + (1.0 if n == "layer_norm_weight" else 0.0))
    plain.load_state_dict(m.state_dict())
    recipe = {"delayed": tec.recipe.DelayedScaling, "current": tec.recipe.Float8CurrentScaling}[recipe_name]()
    if fp8_buf:  # step 1's input is twice step 0's: an FP8 output cast with step 0's scale needs margin 1
        recipe = tec.recipe.DelayedScaling(margin=1)
    label = (f"fp8={recipe_name} {activation} {normalization} {'+'.join(sorted(flags)) or 'no-ub'} {mode} tp={tp}"
             + (" fp8_buf" if fp8_buf else ""))

    def near(a, b, what, output=False):
        if not fp8_buf:
            return close(a, b, what)
        err = compare(what, a, b, rtol=FP8_TOL["rtol"], atol=fp8_partials_atol(b) if output else FP8_TOL["atol"])
        assert err is None, err
    grad = mode not in ("no_grad", "inference_mode")
    for step in range(2 if grad else 1):
        g = torch.Generator().manual_seed(1000 + step)
        dt = kw["params_dtype"]
        x = (torch.randn(SEQ * tp, B, H, generator=g, device="cpu") * (1 + step)).chunk(tp, 0)[rank].to(dev, dt)
        dy = torch.randn(SEQ * tp, B, H, generator=g, device="cpu").chunk(tp, 0)[rank].to(dev, dt)
        before = counts(True)
        res = []
        for mod in (m, plain):
            xi = x.clone().requires_grad_(grad)
            with tec.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                y = run_mode(mod, xi, mode)
            if grad:
                (y * dy).sum().backward()
            res.append((y, xi.grad, [p.grad for p in mod.parameters()]))
            if mod is m:
                after = counts(True)
        for key, n in expected(flags, mode).items():
            ran = after[key] - before[key]
            assert ran == n, f"{label} step {step}: {key[0]}.{key[1]} moved by {ran}, expected {n}"
        if fp8_buf and flags.get("ub_overlap_rs"):  # FP8 bytes and their scale_inv in every push
            key = ("fc2_fprop", "bytes_sent")
            chunk = (SEQ * B * H + 15) // 16 * 16 + 16
            pushes = (after[("fc2_fprop", "rs_overlap")] - before[("fc2_fprop", "rs_overlap")]) * (tp - 1)
            assert after[key] - before[key] == pushes * chunk > 0, (after[key] - before[key], pushes, chunk)
        (y, dx, grads), (yp, dxp, gradsp) = res
        near(y, yp, f"{label} step {step}: output vs without userbuffers", output=True)
        if grad:
            near(dx, dxp, f"{label} step {step}: input grad vs without userbuffers")
            for (n, _), a, b in zip(m.named_parameters(), grads, gradsp):
                near(a, b, f"{label} step {step}: grad of {n} vs without userbuffers")
    return label


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--fp8", choices=["delayed", "current"], default=None,
                    help="the FP8 cases instead (every flag combination and grad mode)")
    ap.add_argument("--fp8-buf", action="store_true",
                    help="with --fp8 delayed: bf16, fc2_fprop's ub_cfgs fp8_buf (FP8 reduce-scatter partials)")
    args = ap.parse_args()
    if args.fp8_buf and args.fp8 != "delayed":
        raise SystemExit("--fp8-buf needs --fp8 delayed")
    rank, tp, dev = setup(args.device)
    if args.fp8:
        return main_fp8(args, rank, tp, dev)
    init_ub((SEQ * B * tp, H), tp, dtype=torch.float32)  # bf16 layers reinterpret the same bytes
    cases = [(a, nrm, UB_COMBOS[-2], "train") for a in ACTS for nrm in ("LayerNorm", "RMSNorm")]
    cases += [("swiglu", "LayerNorm", f, mode) for f in UB_COMBOS for mode in GRAD_MODES]
    cases += [("gelu", "RMSNorm", UB_COMBOS[-1], mode) for mode in GRAD_MODES]
    ln_opts = [dict(return_layernorm_output=True), dict(return_layernorm_output=True,
                                                        return_layernorm_output_gathered=True)]
    cases += [("swiglu", "LayerNorm", f, "train", torch.float32, o) for f in (UB_COMBOS[0], UB_COMBOS[-2])
              for o in ln_opts]
    cases += [("gelu", "LayerNorm", f, "train", torch.bfloat16) for f in (UB_COMBOS[0], UB_COMBOS[-1])]
    run_all([lambda c=c: check_case(*c[:4], tp, rank, dev, *c[4:]) for c in cases]
            + [lambda: list(check_distributed_weight(dev, tp, rank))], rank, f"cases, {tp} ranks, {dev.type}")


def run_all(cases, rank, what):
    """Run each case (returning its label, or a list of them) under the
    saved-tensor checker, print "ok" lines, then the checker's verdict and
    the pass line; tear down the registry and the group."""
    n = 0
    with tec.debug.check_saved_tensors() as chk:
        for case in cases:
            labels = case()
            for label in labels if isinstance(labels, list) else [labels]:
                n += 1
                if rank == 0:
                    print(f"ok {label}", flush=True)
    assert chk.checked > 0 and not chk.violations, (chk.checked, chk.violations)
    tec.destroy_ub()
    dist.barrier()
    if rank == 0:
        print(f"ok saved-tensor check: {chk.checked} saved tensors, no alias of a buffer", flush=True)
        print(f"PASS run_layernorm_mlp ({n} {what})", flush=True)
    dist.destroy_process_group()


def main_fp8(args, rank, tp, dev):
    mode = tec.module.base.UserBufferQuantizationMode
    init_ub((SEQ * B * tp, H), tp, dtype=torch.float32, quantization_modes=[mode.NONE, mode.FP8],
            ub_cfgs={"fc2_fprop": {"method": "pipeline", "fp8_buf": True}} if args.fp8_buf else None)
    if args.fp8_buf:
        cases = [("gelu", "LayerNorm", f, gm) for f in (UB_COMBOS[2], UB_COMBOS[-1]) for gm in GRAD_MODES]
        cases += [("swiglu", "RMSNorm", UB_COMBOS[-2], "train")]
    else:
        cases = [("swiglu", "LayerNorm", f, gm) for f in UB_COMBOS for gm in GRAD_MODES]
        cases += [(a, "RMSNorm", UB_COMBOS[-1], "train") for a in ("gelu", "relu")]
    run_all([lambda c=c: check_case_fp8(*c, tp, rank, dev, args.fp8, args.fp8_buf) for c in cases], rank,
            f"FP8 cases, {tp} ranks, {dev.type}")


if __name__ == "__main__":
    main()
