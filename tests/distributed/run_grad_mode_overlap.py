"""Grad mode never switches an overlap off. For every layer and forward
overlap (LayerNormLinear AG, Linear column AG, Linear row RS): a forward under
torch.no_grad() and under torch.inference_mode() takes the overlapped path
(the communicator's stats() counter moves by one) and matches the layer
without overlap; one training step under reentrant checkpointing (first
forward under no_grad, recompute with grad) counts two overlapped forwards,
as does non-reentrant checkpointing; gradients match the plain layer.
Prints "PASS run_grad_mode_overlap".

    torchrun --nproc_per_node=2 tests/distributed/run_grad_mode_overlap.py [--device cuda]
"""
import argparse
import sys

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from common import rel_err
from transformer_engine_c._launch import init_rank

SEQ, HID, OUT = 8, 32, 48  # SEQ: tokens per rank


def check(label, a, b):
    err = rel_err(a, b)
    assert err <= 1e-5, f"{label}: relative error {err:.3g} > 1e-5"


CASES = [  # (name, layer class, parallel mode, overlap flag, counter, input is a sequence shard)
    ("LayerNormLinear AG", tec.LayerNormLinear, "column", "ub_overlap_ag", "ag_overlap"),
    ("Linear column AG", tec.Linear, "column", "ub_overlap_ag", "ag_overlap"),
    ("Linear row RS", tec.Linear, "row", "ub_overlap_rs", "rs_overlap"),
]


def run_case(name, cls, mode, flag, counter, tp, device):
    comm = tec.CommOverlap((SEQ * tp, max(HID, OUT)), torch.float32, device=device, name=f"gm_{flag}_{mode}",
                           min_chunk_flops=0)  # these tiny shapes would fall back on a GPU
    kw = dict(params_dtype=torch.float32, device=device, parallel_mode=mode, sequence_parallel=True,
              tp_group=dist.group.WORLD, tp_size=tp)
    in_f = HID if mode == "column" else OUT
    out_f = OUT if mode == "column" else HID
    torch.manual_seed(5)
    ub = cls(in_f, out_f, ub_comm=comm, **{flag: True}, **kw)
    ref = cls(in_f, out_f, **kw)
    with torch.no_grad():
        for p in ub.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref.load_state_dict(ub.state_dict())
    g = torch.Generator(device).manual_seed(100 + dist.get_rank())
    rows = SEQ if mode == "column" else SEQ * tp
    x = torch.randn(rows, ub.in_local, generator=g, device=device)

    def count():
        return comm.stats()[counter]

    y_ref = ref(x).detach()
    for ctx_name, ctx in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        before = count()
        with ctx():
            y = ub(x)
        assert count() - before == 1, f"{name} under {ctx_name}: {counter} moved by {count() - before}, not 1"
        check(f"{name} output under {ctx_name}", y.clone(), y_ref)

    dy = torch.randn(y_ref.shape, generator=g, device=device)
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    for reentrant in (True, False):
        ub.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        before = count()
        y = tec.checkpoint(ub, xi, use_reentrant=reentrant)
        y.backward(dy)
        what = f"{name} under {'reentrant' if reentrant else 'non-reentrant'} checkpoint"
        assert count() - before == 2, f"{what}: {counter} moved by {count() - before} in one step, not 2"
        check(f"{what}: output", y, y_ref)
        check(f"{what}: input grad", xi.grad, xr.grad)
        for (n, p), (_, pr) in zip(ub.named_parameters(), ref.named_parameters()):
            check(f"{what}: grad of {n}", p.grad, pr.grad)
    comm.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    rank, tp, device = init_rank(args.device)
    # Every tensor saved for backward in every configuration is checked
    # against every live communicator's ranges (own and peers'): raises on aliasing.
    with tec.debug.check_saved_tensors() as chk:
        for case in CASES:
            run_case(*case, tp, device)
            dist.barrier()
            if rank == 0:
                print(f"ok {case[0]} tp={tp}", flush=True)
    assert chk.checked > 0 and not chk.violations, (chk.checked, chk.violations)
    if dist.get_rank() == 0:
        print(f"ok saved-tensor check: {chk.checked} saved tensors, no alias of a buffer", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print("PASS run_grad_mode_overlap", flush=True)


if __name__ == "__main__":
    sys.exit(main())
