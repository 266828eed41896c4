"""Rank 1 asks for a communicator larger than the machine's memory, the
others for a small one: every rank raises MemoryError (rank 1 naming the
size, the others rank 1), before any peer maps anything; the same through
initialize_ub; then a communicator that fits works. Prints
"PASS run_create_fails" on rank 0.
    torchrun --nproc_per_node=2 tests/distributed/run_create_fails.py
"""
import sys

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank

HUGE = 1 << 22  # (tp * 2^22) x 2^22 float32: 128 TiB at tp=2, more than any machine's memory


def main():
    rank, tp, _ = init_rank("cpu")
    shape = (tp * HUGE, HUGE) if rank == 1 else (tp * 8, 16)
    try:
        tec.CommOverlap(shape, torch.float32, tp_group=dist.group.WORLD, timeout=20, name="big")
    except MemoryError as e:
        msg = str(e)
        assert ("is more than the memory available" in msg) if rank == 1 else ("on rank 1" in msg), msg
        print(f"rank {rank}: MemoryError: {msg}", flush=True)
    else:
        raise AssertionError(f"rank {rank}: a communicator was made although rank 1 could not make its own")
    dist.barrier()
    try:
        tec.initialize_ub((tp * HUGE, HUGE) if rank == 1 else (tp * 8, 16), tp, dtype=torch.float32,
                          tp_group=dist.group.WORLD, timeout=20)
    except MemoryError as e:
        print(f"rank {rank}: initialize_ub MemoryError: {str(e)[:120]}", flush=True)
    else:
        raise AssertionError(f"rank {rank}: initialize_ub succeeded although rank 1 could not")
    dist.barrier()
    c = tec.CommOverlap((tp * 8, 16), torch.float32, tp_group=dist.group.WORLD, timeout=20, min_chunk_flops=0)
    a, w = torch.randn(8, 16), torch.randn(4, 16)
    y = c.ag_gemm(a, w)
    parts = [torch.empty_like(a) for _ in range(tp)]
    dist.all_gather(parts, a)
    torch.testing.assert_close(y, torch.cat(parts) @ w.t())
    tec.close_comms([c])
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("PASS run_create_fails", flush=True)


if __name__ == "__main__":
    sys.exit(main())
