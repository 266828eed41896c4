"""FP8 amax reductions on 2 ranks over gloo: delayed scaling's forward amaxes
are max-reduced over the autocast's group when the outermost autocast exits
(the same scale on every rank), not with reduce_amax=False; the backward
ones when the first module's backward asks; current scaling's quantizer
reduces over its amax_reduction_group. Prints "PASS run_fp8_amax" on rank
0; tests/distributed/test_fp8_amax.py requires it and every rank's exit 0."""
import gc
import weakref

import torch
import torch.distributed as dist

import transformer_engine_c as te
from transformer_engine_c import _fp8_meta
from transformer_engine_c._launch import init_rank
from transformer_engine_c.quantization import FP8GlobalStateManager as G
from transformer_engine_c.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def step(meta, x, recipe, group):
    with te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group):
        with te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group):  # nested: no reduction here
            G.add_fp8_tensors_to_global_buffer(meta)
            fwd = meta["scaling_fwd"]
            Float8Quantizer(fwd.scale[0:1], fwd.amax_history[0][0:1], torch.float8_e4m3fn)(x)
        check(fwd.scale[0].item() == 1.0, "the scale changed before the outermost exit")


def main():
    rank, size, _ = init_rank("cpu")
    assert size == 2
    world = dist.group.WORLD
    local_amax = 1.0 + 3.0 * rank  # 1 on rank 0, 4 on rank 1
    x = torch.full((8, 16), local_amax)

    recipe = te.recipe.DelayedScaling(amax_history_len=4)
    meta = _fp8_meta.make_fp8_meta(recipe)
    step(meta, x, recipe, world)
    check(meta["scaling_fwd"].scale[0].item() == 112.0, f"rank {rank}: forward scale "
          f"{meta['scaling_fwd'].scale[0].item()} is not 448 / the global amax 4")
    meta["scaling_bwd"].amax_history[0, 0] = local_amax
    G.reduce_and_update_fp8_tensors(forward=False)
    check(meta["scaling_bwd"].scale[0].item() == 57344.0 / 4.0, f"rank {rank}: backward scale not reduced")

    G.reset()
    local = te.recipe.DelayedScaling(amax_history_len=4, reduce_amax=False)
    meta = _fp8_meta.make_fp8_meta(local)
    step(meta, x, local, world)
    want = 448.0 / local_amax
    check(meta["scaling_fwd"].scale[0].item() == want, f"rank {rank}: reduce_amax=False reduced anyway")
    got = torch.tensor([meta["scaling_fwd"].scale[0].item()])
    scales = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(scales, got)
    check(scales[0].item() != scales[1].item(), "without reduction the ranks' scales should differ")

    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, "cpu", with_amax_reduction=True, amax_reduction_group=world)
    t = q(x)
    check(q.amax.item() == 4.0 and q.scale.item() == 112.0, f"rank {rank}: current scaling amax not reduced")
    check(t._scale_inv.item() == torch.tensor(1 / 112.0).item(), "scale_inv")
    G.reset()
    dist.barrier()
    # nothing of the package keeps the group alive past destroy_process_group (a gloo group released in
    # the interpreter's finalization aborts the process)
    gone = weakref.ref(world)
    del world, q, t
    dist.destroy_process_group()
    gc.collect()
    check(gone() is None, f"rank {rank}: the process group outlived destroy_process_group: "
          f"{[type(r).__name__ for r in gc.get_referrers(gone())] if gone() is not None else ''}")
    if rank == 0:
        print("PASS run_fp8_amax", flush=True)


if __name__ == "__main__":
    main()
