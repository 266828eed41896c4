"""torchrun runner: Linear and LayerNormLinear whose `weight` is a
DistributedWeight sharded (dim 0) over a data-parallel group, with and without
tensor parallelism, under: no hooks, identity saved-tensor hooks,
CPU-offload-style hooks, tec.checkpoint and torch.utils.checkpoint (reentrant
and not). Output, input grad and every parameter grad (the sharded weight's
included, read from .grad or .main_grad) must match the same layer with a plain
full weight; the backward must see the original DistributedWeight (it gathers
again in backward: gather_count). Prints "PASS run_distributed_weight".

    torchrun --nproc_per_node=2 tests/distributed/run_distributed_weight.py
    (2 ranks: dp=2 x tp=1 and dp=1 x tp=2; 4 ranks adds dp=2 x tp=2)
    --no-keep-references replaces prepare_for_saving / restore_from_saved with a
    double that does not keep by reference (tests/helpers.py): the run must fail.
"""
import argparse
import contextlib
import itertools
import os
import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
import transformer_engine_c as tec  # noqa: E402
from common import rel_err  # noqa: E402
from helpers import without_keep_by_reference  # noqa: E402
from transformer_engine_c._launch import init_rank  # noqa: E402

TOL = 1e-5
DEVICE = torch.device("cpu")
MODES = ["none", "identity", "offload", "tec_ckpt_reentrant", "tec_ckpt", "torch_ckpt_reentrant", "torch_ckpt"]


@contextlib.contextmanager
def hooks(mode):
    if mode == "identity":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            yield
    elif mode == "offload":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().to("cpu", copy=True),
                                                      lambda t: t.to(DEVICE, copy=True)):
            yield
    else:
        yield


def run(m, x, mode):
    with hooks(mode):
        if mode.startswith("tec_ckpt"):
            return tec.checkpoint(m, x, use_reentrant=mode.endswith("reentrant"))
        if mode.startswith("torch_ckpt"):
            return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=mode.endswith("reentrant"))
        return m(x)


class Groups:
    def __init__(self, dp, tp):
        world, rank = dist.get_world_size(), dist.get_rank()
        assert dp * tp == world
        self.dp, self.tp = dp, tp
        self.dp_rank, self.tp_rank = rank // tp, rank % tp
        self.tp_group = self.dp_group = None
        for d in range(dp):  # every rank creates every group, in the same order
            g = dist.new_group([d * tp + t for t in range(tp)])
            if d == self.dp_rank:
                self.tp_group = g
        for t in range(tp):
            g = dist.new_group([d * tp + t for d in range(dp)])
            if t == self.tp_rank:
                self.dp_group = g


def check_case(kind, mode, sp, g, run_mode, main_grad):
    S, B, IN, OUT = 8, 2, 16, 12
    torch.manual_seed(1234)  # same parameters on every rank
    cls = tec.LayerNormLinear if kind == "LayerNormLinear" else tec.Linear
    tp_kw = dict(parallel_mode=mode, sequence_parallel=sp, tp_group=g.tp_group if g.tp > 1 else None,
                 tp_size=g.tp)
    ref = cls(IN, OUT, device=DEVICE, **tp_kw)
    with torch.no_grad():  # rank-specific TP shards, non-trivial biases
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape).to(DEVICE) * 0.3 + 0.1 * g.tp_rank)
    m = cls(IN, OUT, device=DEVICE, **tp_kw)  # (layers holding a process group cannot be deep-copied)
    m.load_state_dict(ref.state_dict())
    local_w = ref.weight.detach()
    rows = local_w.shape[0] // g.dp
    m.weight = tec.DistributedWeight(local_w[g.dp_rank * rows:(g.dp_rank + 1) * rows].clone(),
                                     local_w.shape, group=g.dp_group)
    if main_grad:
        m.weight.main_grad = torch.zeros_like(m.weight.detach())

    # data parallel: different data per dp rank; the TP group shares it (split along seq under SP)
    gen = torch.Generator().manual_seed(99 + g.dp_rank)
    x_local = torch.randn(S, B, IN, generator=gen)
    if sp and mode == "column":
        x_local = x_local.chunk(g.tp, 0)[g.tp_rank]
    if mode == "row":
        x_local = x_local.chunk(g.tp, 2)[g.tp_rank]

    x_local = x_local.to(DEVICE)
    xr = x_local.clone().requires_grad_()
    yr = ref(xr)
    dy = torch.randn(yr.shape, generator=gen).to(DEVICE)
    yr.backward(dy)
    x = x_local.clone().requires_grad_()
    gathers = m.weight.gather_count
    y = run(m, x, run_mode)
    y.backward(dy)

    label = f"{kind} mode={mode} sp={sp} dp={g.dp} tp={g.tp} {run_mode}{' main_grad' if main_grad else ''}"
    want_gathers = 3 if "ckpt" in run_mode else 2
    if m.weight.gather_count - gathers != want_gathers:
        raise AssertionError(f"{label}: the weight was gathered {m.weight.gather_count - gathers} times, expected "
                             f"{want_gathers} (backward did not get the original DistributedWeight)")
    # the reference's full weight grad, summed over data-parallel ranks, this rank's rows
    wg = ref.weight.grad.clone()
    if g.dp > 1:
        dist.all_reduce(wg, group=g.dp_group)
    wg = wg[g.dp_rank * rows:(g.dp_rank + 1) * rows]
    got_wg = m.weight.main_grad if main_grad else m.weight.grad
    errs = {"output": rel_err(y, yr), "input grad": rel_err(x.grad, xr.grad),
            "weight grad (shard)": rel_err(got_wg, wg) if got_wg is not None else float("inf")}
    if main_grad and m.weight.grad is not None:
        errs["weight .grad set although main_grad exists"] = float("inf")
    for (name, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
        if name != "weight":
            errs[name + " grad"] = rel_err(p.grad, pr.grad)
    bad = {k: v for k, v in errs.items() if not v < TOL}
    if bad:
        raise AssertionError(f"rank {dist.get_rank()}: {label}: errors over {TOL}: {bad}")
    return label


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-keep-references", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    global DEVICE
    _, _, DEVICE = init_rank(args.device)
    world = dist.get_world_size()
    if args.no_keep_references:  # for the whole run (the context object is kept: its exit would undo it)
        global _NO_REFS
        _NO_REFS = without_keep_by_reference()
        _NO_REFS.__enter__()
    layouts = [(world, 1), (1, world)] + ([(2, world // 2)] if world >= 4 and world % 2 == 0 else [])
    n = 0
    for dp, tp in layouts:
        g = Groups(dp, tp)
        if tp == 1:
            cases = [("Linear", None, False), ("LayerNormLinear", None, False)]
        else:
            cases = [(k, mo, sp) for (k, mo), sp in itertools.product(
                [("Linear", "column"), ("Linear", "row"), ("LayerNormLinear", "column")], [False, True])]
        for (kind, mode, sp), (i, run_mode) in itertools.product(cases, enumerate(MODES)):
            label = check_case(kind, mode, sp, g, run_mode, main_grad=bool(i % 2))
            n += 1
            if dist.get_rank() == 0:
                print(f"ok {label}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"PASS run_distributed_weight ({n} cases, {world} ranks, {DEVICE.type})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
