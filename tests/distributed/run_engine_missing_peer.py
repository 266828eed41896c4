"""torchrun runner (2 CUDA ranks, NCCL): a peer that stops issuing the
engine's collectives. Both ranks make the group's communicator with one
all-gather (timeout_s=TIMEOUT) and check it; then rank 1 skips the next
all-gather and sleeps. Rank 0's all-gather waits on the GPU for a peer that
never comes: its watchdog must end rank 0 (exit 1) about TIMEOUT s after
the collective was enqueued, saying on stderr which collective of which
group, rank and device. Success is that message and a non-zero exit
(tests/distributed/test_engine_collectives.py); a line starting "FAIL"
means the process outlived the watchdog.

    torchrun --nproc_per_node=2 tests/distributed/run_engine_missing_peer.py
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformer_engine_c import distributed  # noqa: E402
from common import setup  # noqa: E402

TIMEOUT = 10.0


def main():
    rank, size, dev = setup("cuda")
    assert size == 2, "run_engine_missing_peer needs 2 ranks"
    group = dist.new_group([0, 1])
    distributed.set_collectives("engine", timeout_s=TIMEOUT)
    x = torch.full((4, 8), float(rank + 1))
    out = torch.empty(8, 8)
    distributed._all_gather_into(out, x, group, False)  # collective #1: makes the communicator
    torch.cuda.synchronize()
    assert torch.equal(out[:4], torch.full_like(x, 1.0)) and torch.equal(out[4:], torch.full_like(x, 2.0)), \
        f"rank {rank}: the first all-gather is wrong"
    dist.barrier()
    print(f"rank {rank}: communicator made", flush=True)
    if rank == 0:
        t0 = time.monotonic()
        distributed._all_gather_into(out, x, group, False)  # collective #2: rank 1 never joins
        print("rank 0 enqueued the all-gather rank 1 skips", flush=True)
        torch.cuda.synchronize()  # the watchdog ends the process while this waits
        print(f"FAIL: rank 0's all-gather finished after {time.monotonic() - t0:.1f} s without its peer", flush=True)
        sys.exit(3)
    time.sleep(TIMEOUT * 6)
    print("FAIL: rank 1 outlived rank 0's watchdog", flush=True)
    sys.exit(4)


if __name__ == "__main__":
    main()
