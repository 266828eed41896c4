"""The tensor-parallel layers under torch.compile(fullgraph=True), with and
without userbuffers: each compiled layer (and a compiled block of them)
gives the eager layer's output and gradients bit for bit over three steps
(the same engine and collectives run both), no graph breaks, and the
communicators' stats() show the overlapped paths ran inside the compiled
steps. Prints "PASS run_compile_tp".

    torchrun --nproc_per_node=2 tests/distributed/run_compile_tp.py [--device cuda]
"""
import argparse
import sys

import torch
import torch._dynamo
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank

SEQ, HID, FFN = 8, 32, 64  # SEQ: tokens per rank


def same(label, a, b):
    assert a.shape == b.shape and torch.equal(a, b), f"{label}: compiled differs from eager by " \
        f"{(a.float() - b.float()).abs().max().item():.3g}"


def step(m, x, dy):
    xi = x.clone().requires_grad_()
    y = m(xi)
    y.backward(dy)
    return y.detach(), xi.grad, [p.grad.clone() for p in m.parameters()]


def compare(label, make, x_of, counters=()):
    """Three steps of a layer from `make` and of a compiled twin (the same
    seed); counters: (comm, key) whose stats() must move in the compiled
    steps as in the eager ones."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(1)
    eager = make()
    torch.manual_seed(1)
    twin = make()
    compiled = torch.compile(twin, fullgraph=True)
    for s in range(3):
        x, dy = x_of(s)
        moved = [c.stats()[k] for c, k in counters]
        ye, gxe, gpe = step(eager, x, dy)
        eager_moves = [c.stats()[k] - m for (c, k), m in zip(counters, moved)]
        moved = [c.stats()[k] for c, k in counters]
        yc, gxc, gpc = step(compiled, x, dy)
        compiled_moves = [c.stats()[k] - m for (c, k), m in zip(counters, moved)]
        assert compiled_moves == eager_moves and all(eager_moves), \
            f"{label}: overlapped calls eager {eager_moves}, compiled {compiled_moves}"
        same(f"{label} step {s} output", ye, yc)
        same(f"{label} step {s} input grad", gxe, gxc)
        for (n, _), a, b in zip(eager.named_parameters(), gpe, gpc):
            same(f"{label} step {s} grad of {n}", a, b)
        for p in list(eager.parameters()) + list(twin.parameters()):
            p.grad = None
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, f"{label}: {breaks} graph breaks"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    rank, tp, device = init_rank(args.device)
    group = dist.group.WORLD
    kw = dict(params_dtype=torch.float32, device=device, sequence_parallel=True, tp_group=group, tp_size=tp)
    g = torch.Generator(device).manual_seed(100 + rank)

    def data(rows, cols, out_rows, out_cols):
        return lambda s: (torch.randn(rows, cols, generator=g, device=device),
                          torch.randn(out_rows, out_cols, generator=g, device=device))

    comms = []

    def comm(name):
        comms.append(tec.CommOverlap((SEQ * tp, FFN), torch.float32, device=device, name=name, min_chunk_flops=0))
        return comms[-1]

    torch.manual_seed(1)
    # without userbuffers: the process group's collectives
    compare("Linear column", lambda: tec.Linear(HID, FFN, parallel_mode="column", **kw),
            data(SEQ, HID, SEQ * tp, FFN // tp))
    compare("Linear row", lambda: tec.Linear(FFN, HID, parallel_mode="row", **kw), data(SEQ * tp, FFN // tp, SEQ, HID))
    compare("LayerNormMLP", lambda: tec.LayerNormMLP(HID, FFN, set_parallel_mode=True, **kw),
            data(SEQ, HID, SEQ, HID))
    # with userbuffers: the overlapped schedules, counted
    c = comm("cc_ln_ag")
    compare("LayerNormLinear ub_overlap_ag", lambda: tec.LayerNormLinear(HID, FFN, parallel_mode="column", ub_comm=c,
                                                                 ub_overlap_ag=True, **kw),
            data(SEQ, HID, SEQ * tp, FFN // tp), [(c, "ag_overlap")])
    c = comm("cc_rs")
    compare("Linear row ub_overlap_rs", lambda: tec.Linear(FFN, HID, parallel_mode="row", ub_comm=c, ub_overlap_rs=True,
                                                   **kw),
            data(SEQ * tp, FFN // tp, SEQ, HID), [(c, "rs_overlap")])
    c = comm("cc_mlp")
    compare("LayerNormMLP ub_overlap_ag+rs", lambda: tec.LayerNormMLP(HID, FFN, set_parallel_mode=True, ub_comm=c,
                                                              ub_overlap_ag=True, ub_overlap_rs=True, **kw),
            data(SEQ, HID, SEQ, HID), [(c, "ag_overlap"), (c, "rs_overlap")])
    c, c2 = comm("cc_ln_bulk_d"), comm("cc_ln_bulk_w")
    compare("LayerNormLinear ub_bulk_dgrad+wgrad", lambda: tec.LayerNormLinear(
        HID, FFN, parallel_mode="column", ub_comm={"dgrad": c, "wgrad": c2}, ub_bulk_dgrad=True, ub_bulk_wgrad=True,
        **kw), data(SEQ, HID, SEQ * tp, FFN // tp), [(c, "bulk_ag"), (c2, "bulk_rs")])
    c = comm("cc_mlp_rsd")
    compare("LayerNormMLP ub_overlap_rs_dgrad", lambda: tec.LayerNormMLP(
        HID, FFN, set_parallel_mode=True, ub_comm=c, ub_overlap_ag=True, ub_overlap_rs_dgrad=True, **kw),
        data(SEQ, HID, SEQ, HID), [(c, "ag_overlap"), (c, "rs_overlap")])
    for c in comms:
        c.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("PASS run_compile_tp", flush=True)


if __name__ == "__main__":
    sys.exit(main())
