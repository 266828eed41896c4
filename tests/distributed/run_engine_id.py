"""torchrun runner (2+ ranks, CPU, gloo): the engine communicator's id
exchange (distributed._shared_id) gives every rank of a group the bytes its
rank 0 made, a fresh id per call, on the default group and on a subgroup
whose rank 0 is not global rank 0. Prints "PASS run_engine_id".

    torchrun --nproc_per_node=2 tests/distributed/run_engine_id.py
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformer_engine_c import distributed  # noqa: E402
from common import setup  # noqa: E402


def main():
    rank, size, _ = setup("cpu")
    cpu = torch.device("cpu")
    groups = [dist.group.WORLD, dist.new_group(list(range(size))[::-1])]  # the second: rank 0 is the last rank
    for group in groups:
        seen = []
        for call in range(3):
            made = os.urandom(128)
            got = distributed._shared_id(group, cpu, lambda: made)
            everyone = [None] * size
            dist.all_gather_object(everyone, (dist.get_rank(group), made, got))
            root = next(m for r, m, _ in everyone if r == 0)
            assert all(g == root for _, _, g in everyone), f"call {call}: the ranks got different ids"
            assert got not in seen, f"call {call}: an id came back twice"
            seen.append(got)
    solo = dist.new_group([0])  # collective; only rank 0 uses it
    if rank == 0:
        try:
            distributed._shared_id(solo, cpu, lambda: b"short")
        except RuntimeError as e:
            assert "must be 128 bytes" in str(e), e
        else:
            raise AssertionError("a short id was accepted")
    dist.barrier()
    if rank == 0:
        print("PASS run_engine_id", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
