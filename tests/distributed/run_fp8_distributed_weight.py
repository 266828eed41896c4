"""torchrun runner: a DistributedWeight of Float8Tensor shards (FP8 primary
weights sharded over the world) in a Linear under FP8 autocast.

* materialize() all-gathers uint8 bytes (each shard's bytes with its 4
  scale_inv bytes, one collective) and gives the full Float8Tensor
  bit-exactly: the bytes and the one scale of the weight it was cut from;
* forward, input gradient and the shard's weight gradient equal those of
  the same layer holding the full Float8Tensor (its gradient summed over the
  ranks, this rank's rows);
* an optimizer step on the shards (current scaling, the amax reduced over
  the group) leaves every rank with the same scale, so the next gather needs
  no re-scaling; without the reduction the ranks' scales differ and the
  gather re-scales (rescaled_gathers), still giving every rank the same full
  weight (the negative case).
Prints "PASS run_fp8_distributed_weight".

    torchrun --nproc_per_node=2 tests/distributed/run_fp8_distributed_weight.py [--device cuda]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c import distributed_weight as dw_mod  # noqa: E402
from transformer_engine_c._launch import init_rank  # noqa: E402
from transformer_engine_c.recipe import Float8CurrentScaling  # noqa: E402
from transformer_engine_c.tensor.float8_tensor import Float8Tensor  # noqa: E402

BF16 = torch.bfloat16


def same_on_all_ranks(t):
    """Whether t (a tensor) is bit-identical on every rank."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    got = [torch.empty_like(b) for _ in range(dist.get_world_size())]
    dist.all_gather(got, b)
    return all(torch.equal(g, got[0]) for g in got)


def layer(device, recipe):
    torch.manual_seed(1234)  # the same weight on every rank
    with tec.quantized_model_init(enabled=True, recipe=recipe):
        return tec.Linear(64, 32, params_dtype=BF16, device=device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    device = init_rank(args.device)[2]
    world, rank = dist.get_world_size(), dist.get_rank()
    recipe = Float8CurrentScaling()

    ref = layer(device, recipe)
    m = layer(device, recipe)
    full = m.weight
    w = tec.DistributedWeight.from_full(full)
    assert type(w) is dw_mod.Float8DistributedWeight and isinstance(w, torch.nn.Parameter)
    assert w.shape == (32 // world, 64) and w.full_shape == (32, 64)
    m.weight = w

    dtypes = []
    real_gather = dw_mod.all_gather_rows

    def recording(x, group, size, *a, **k):
        dtypes.append((x.dtype, tuple(x.shape)))
        return real_gather(x, group, size, *a, **k)
    dw_mod.all_gather_rows = recording
    g = w.materialize()
    assert type(g) is Float8Tensor and torch.equal(g._data, full._data) and torch.equal(g._scale_inv, full._scale_inv)
    assert dtypes == [(torch.uint8, (1, w.numel() + 4))], dtypes

    gen = torch.Generator().manual_seed(7 + rank)  # data parallel: each rank its own data
    x = torch.randn(16, 64, generator=gen).to(device, BF16)
    dy = torch.randn(16, 32, generator=gen).to(device, BF16)
    outs = []
    for mod in (m, ref):
        xx = x.clone().requires_grad_()
        with tec.autocast(recipe=recipe):
            y = mod(xx)
        y.backward(dy)
        outs.append((y.detach(), xx.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    wg = ref.weight.grad.float()
    dist.all_reduce(wg)
    rows = w.shape[0]
    want = wg[rank * rows:(rank + 1) * rows]
    assert torch.allclose(w.grad.float(), want, rtol=1e-2, atol=1e-2), (w.grad.float() - want).abs().max()
    assert all(dt == torch.uint8 for dt, _ in dtypes)

    # an update casts every shard with the group's amax: one scale, no re-scaling at the gather
    torch.optim.SGD([w], lr=5.0).step()
    assert same_on_all_ranks(w._scale_inv), "the shards' scales differ after an update"
    before = w.rescaled_gathers
    g = w.materialize()
    assert w.rescaled_gathers == before and same_on_all_ranks(g._data)

    # negative: without the amax reduction the ranks' scales differ; the gather re-scales
    m2 = layer(device, recipe)
    w2 = tec.DistributedWeight.from_full(m2.weight)
    w2._quantizer.with_amax_reduction = False
    with torch.no_grad():
        w2.mul_(1.0 + rank)  # rank r's rows scaled by r + 1: different amaxes
    assert world == 1 or not same_on_all_ranks(w2._scale_inv)
    g2 = w2.materialize()
    assert w2.rescaled_gathers == (1 if world > 1 else 0)
    assert same_on_all_ranks(g2._data) and same_on_all_ranks(g2._scale_inv)
    want2 = torch.cat([m2.weight.dequantize().float()[r * rows:(r + 1) * rows] * (1 + r) for r in range(world)])
    assert torch.allclose(g2.dequantize().float(), want2, rtol=0.13, atol=1e-3)

    dist.barrier()
    if rank == 0:
        print(f"PASS run_fp8_distributed_weight ({world} ranks, {args.device})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
