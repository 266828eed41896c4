"""Run inside a private mount namespace whose /dev/shm is a small tmpfs
(tests/test_reliability_shm.py sets it up): a communicator whose regions do
not all fit fails on EVERY rank with a MemoryError naming /dev/shm and the
size, before any peer maps anything, and nothing is left in /dev/shm.
Prints "PASS run_small_shm" on rank 0.

    unshare -m sh -c 'mount -t tmpfs -o size=12m tmpfs /dev/shm && torchrun --nproc_per_node=2 run_small_shm.py'
"""
import os
import sys

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank


def main():
    rank, tp, _ = init_rank("cpu")
    # 4 MiB of data per rank: a region of data + staging + flags is ~8 MiB,
    # so one rank's fits a 12 MiB /dev/shm and the second's does not.
    shape = (tp * 1024, 1024)
    try:
        tec.CommOverlap(shape, torch.float32, tp_group=dist.group.WORLD, timeout=20, name="big")
    except MemoryError as e:
        msg = str(e)
        assert "/dev/shm" in msg, msg
        assert rank == 0 or "bytes" in msg, msg
        print(f"rank {rank}: MemoryError: {msg}", flush=True)
    else:
        raise AssertionError(f"rank {rank}: a communicator larger than /dev/shm was created")
    dist.barrier()
    # initialize_ub: the same, through the registry (several communicators).
    try:
        tec.initialize_ub((tp * 512, 1024), tp, dtype=torch.float32, tp_group=dist.group.WORLD, timeout=20)
    except MemoryError as e:
        assert "/dev/shm" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: initialize_ub larger than /dev/shm succeeded")
    dist.barrier()
    left = [n for n in os.listdir("/dev/shm") if n.startswith("tec-")]
    assert not left, f"rank {rank} (pid {os.getpid()}): left in /dev/shm: {left}"
    dist.barrier()  # every rank has looked before any creates the next one
    # A communicator that fits still works afterwards.
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
        print("PASS run_small_shm", flush=True)


if __name__ == "__main__":
    sys.exit(main())
