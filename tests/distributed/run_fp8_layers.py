"""torchrun runner: the three layers in FP8 under tensor and sequence
parallelism (plain collectives) against the same layer unsharded, in FP8
with the same recipe, on every rank: TE's distributed/run_numerics.py fp8,
fp8_cs and fp8_block_scaling cases with its tolerances (DelayedScaling and
Float8BlockScaling rtol 0.125 / atol 0.0625, Float8CurrentScaling rtol 0.4 /
atol 0.25), over three steps, so
that the second and third run on the scales the amax reductions gave.
Column and row Linear, column LayerNormLinear (LayerNorm and RMSNorm) and
LayerNormMLP (set_parallel_mode), all with sequence parallelism; the
parameters marked `sequence_parallel` have their partial gradients summed
over the group before the comparison. Also checks that after the steps
every rank holds the same delayed-scaling scales. Prints
"PASS run_fp8_layers".

    torchrun --nproc_per_node=2 tests/distributed/run_fp8_layers.py [--device cuda] [--recipes block]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
from common import setup  # noqa: E402
from transformer_engine_c.quantization import FP8GlobalStateManager as G  # noqa: E402
from transformer_engine_c.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402

S, IN, OUT, FFN = 32, 64, 96, 128
TOL = {"delayed": dict(rtol=0.125, atol=0.0625), "current": dict(rtol=0.4, atol=0.25),
       "block": dict(rtol=0.125, atol=0.0625)}
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}


def build(kind, size, device, dtype):
    torch.manual_seed(3)
    common = dict(params_dtype=dtype, device=device)
    if kind == "mlp":
        return tec.LayerNormMLP(IN, FFN, set_parallel_mode=size > 1, sequence_parallel=size > 1, tp_size=size,
                                **common)
    mode = kind.split(":")[1]
    par = dict(parallel_mode=mode, sequence_parallel=size > 1, tp_size=size)
    if kind.startswith("linear"):
        return tec.Linear(IN, OUT, **par, **common)
    norm = "RMSNorm" if kind.startswith("rms") else "LayerNorm"
    return tec.LayerNormLinear(IN, OUT, normalization=norm, **par, **common)


def shard_spec(kind, name):
    """(dim the parameter is split along, or None for replicated)."""
    if kind == "mlp":
        return {"fc1_weight": 0, "fc1_bias": 0, "fc2_weight": 1}.get(name)
    mode = kind.split(":")[1]
    if name == "weight":
        return 0 if mode == "column" else 1
    if name == "bias":
        return 0 if mode == "column" else None
    return None


def piece(t, dim, rank, size):
    return t if dim is None else t.chunk(size, dim)[rank]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", default="delayed,current", help="comma-separated: delayed, current, block")
    args = ap.parse_args()
    rank, size, device = setup(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    world = dist.group.WORLD
    kinds = ["linear:column", "linear:row", "lnlinear:column", "rmslinear:column", "mlp"]
    for recipe_name in args.recipes.split(","):
        make_recipe = RECIPES[recipe_name]
        for kind in kinds:
            G.reset()
            recipe = make_recipe()
            full, part = build(kind, 1, device, dtype), build(kind, size, device, dtype)
            with torch.no_grad():
                for (name, p), (_, q) in zip(full.named_parameters(), part.named_parameters()):
                    p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 2 else 0.5) + (1.0 if "norm" in name else 0))
                    q.copy_(piece(p, shard_spec(kind, name), rank, size))
            row = kind == "linear:row"
            out_features = IN if kind == "mlp" else OUT
            for step in range(3):
                gen = torch.Generator().manual_seed(100 + step)
                x = (torch.randn(S, 2, IN, generator=gen, device="cpu") * (1 + 0.5 * step)).to(device, dtype)
                dy = (torch.randn(S, 2, out_features, generator=gen, device="cpu") * 0.05).to(device, dtype)
                xf = x.clone().requires_grad_()
                xp = (x.chunk(size, 2)[rank] if row else x.chunk(size, 0)[rank]).clone().requires_grad_()
                for m in (full, part):
                    for p in m.parameters():
                        p.grad = None
                with tec.autocast(enabled=True, recipe=recipe, amax_reduction_group=world):
                    yf = full(xf)
                    yp = part(xp)
                yf.backward(dy)
                col = kind.endswith("column")
                yp.backward(dy.chunk(size, 2)[rank] if col else dy.chunk(size, 0)[rank])
                what = f"rank {rank} {recipe_name} {kind} step {step}"
                want_y = yf.chunk(size, 2)[rank] if col else yf.chunk(size, 0)[rank]
                torch.testing.assert_close(yp.float(), want_y.float(), **TOL[recipe_name], msg=lambda m: f"{what} "
                                           f"output: {m}")
                want_dx = xf.grad.chunk(size, 2)[rank] if row else xf.grad.chunk(size, 0)[rank]
                torch.testing.assert_close(xp.grad.float(), want_dx.float(), **TOL[recipe_name],
                                           msg=lambda m: f"{what} input grad: {m}")
                for (name, p), (_, q) in zip(full.named_parameters(), part.named_parameters()):
                    g = q.grad.float()
                    if getattr(q, "sequence_parallel", False):
                        dist.all_reduce(g, group=world)
                    want = piece(p.grad, shard_spec(kind, name), rank, size).float()
                    torch.testing.assert_close(g, want, **TOL[recipe_name],
                                               msg=lambda m: f"{what} {name} grad: {m}")
            if recipe_name == "delayed":
                for key in ("scaling_fwd", "scaling_bwd"):
                    s = part.fp8_meta[key].scale.clone()
                    ref = s.clone()
                    dist.broadcast(ref, 0)
                    if not torch.equal(s, ref):
                        raise AssertionError(f"rank {rank} {kind}: {key} scales differ between ranks")
    G.reset()
    dist.barrier()
    if rank == 0:
        print("PASS run_fp8_layers", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
