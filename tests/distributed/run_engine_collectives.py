"""torchrun runner (2+ CUDA ranks, NCCL): the engine's own NCCL communicator
(set_collectives("engine")) gives the process group's bits: all-gather,
reduce-scatter and all-reduce (fp32, bf16, fp16; synchronous and
asynchronous), the sequence-parallel layers' forward and backward
(LayerNormLinear column, Linear row, LayerNormMLP), and the collectives
captured in a CUDA graph and replayed. Prints "PASS run_engine_collectives".

    torchrun --nproc_per_node=2 tests/distributed/run_engine_collectives.py
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c import distributed  # noqa: E402
from common import setup  # noqa: E402


def both(fn):
    """fn() with the process group's collectives, then with the engine's."""
    return [distributed.with_collectives(kind, fn)() for kind in ("torch", "engine")]


def collectives(rank, size, group):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(rank)
        x = torch.randn(6 * size, 10).to(dtype)

        def run():
            ag = torch.empty(size * x.shape[0], 10, dtype=dtype)
            distributed._all_gather_into(ag, x, group, False)
            ag2 = torch.empty_like(ag)
            distributed._all_gather_into(ag2, x * 2, group, True).wait()
            rs = torch.empty(x.shape[0] // size, 10, dtype=dtype)
            distributed._reduce_scatter_into(rs, x, group)
            ar = x.clone()
            distributed.all_reduce(ar, group, size)
            return [ag, ag2, rs, ar]
        ref, got = both(run)
        for name, a, b in zip(("all-gather", "async all-gather", "reduce-scatter", "all-reduce"), ref, got):
            assert torch.equal(a, b), f"rank {rank}: {name} {dtype} differs"


def layers(rank, size, group):
    for kind in ("column", "row", "mlp"):
        for dtype in (torch.float32, torch.bfloat16):
            def run():
                torch.manual_seed(11)
                if kind == "column":
                    m = tec.LayerNormLinear(32, 24, params_dtype=dtype, parallel_mode="column",
                                            sequence_parallel=True, tp_group=group, tp_size=size)
                elif kind == "row":
                    m = tec.Linear(32, 24, params_dtype=dtype, parallel_mode="row", sequence_parallel=True,
                                   tp_group=group, tp_size=size)
                else:
                    m = tec.LayerNormMLP(32, 48, params_dtype=dtype, set_parallel_mode=True,
                                         sequence_parallel=True, tp_group=group, tp_size=size)
                torch.manual_seed(100 + rank)
                x = torch.randn(8, 32 // size if kind == "row" else 32, dtype=dtype, requires_grad=True)
                y = m(x)
                y.backward(torch.randn_like(y))
                return [y.detach(), x.grad] + [p.grad for p in m.parameters()]
            ref, got = both(run)
            for i, (a, b) in enumerate(zip(ref, got)):
                assert torch.equal(a, b), f"rank {rank}: {kind} {dtype} tensor {i} differs"


def graphed(rank, size, group):
    distributed.set_collectives("engine")
    x = torch.randn(4 * size, 16)
    ag = torch.empty(size * x.shape[0], 16)
    rs = torch.empty(x.shape[0], 16)  # this rank's share of ag's sum

    def step():
        distributed._all_gather_into(ag, x, group, True).wait()
        distributed._reduce_scatter_into(rs, ag, group)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for i in range(20):
        torch.manual_seed(1000 * i + rank)
        x.copy_(torch.randn_like(x))
        g.replay()
        want_ag, want_rs = torch.empty_like(ag), torch.empty_like(rs)

        def reference():  # eager, through the process group
            distributed._all_gather_into(want_ag, x, group, False)
            distributed._reduce_scatter_into(want_rs, want_ag, group)
        distributed.with_collectives("torch", reference)()
        assert torch.equal(ag, want_ag) and torch.equal(rs, want_rs), f"rank {rank}: replay {i}"
    distributed.set_collectives("torch")


def main():
    rank, size, dev = setup("cuda")
    group = dist.new_group(list(range(size)))
    collectives(rank, size, group)
    layers(rank, size, group)
    graphed(rank, size, group)
    assert distributed._engine_comms, "the engine's communicator was never made"
    distributed.close_engine_collectives()
    dist.barrier()
    if rank == 0:
        print("PASS run_engine_collectives", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
