"""Rank $TEC_TEST_KILL_RANK SIGKILLs itself inside initialize_ub, after its
regions exist and before the names are unlinked (while the handles are
exchanged). The others fail with a clear error (a dead peer) instead of
hanging. Used by tests/test_reliability_shm.py, which then checks /dev/shm."""
import os
import signal
import sys

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c import userbuffers
from transformer_engine_c._launch import init_rank


def main():
    rank, tp, _ = init_rank("cpu")
    victim = int(os.environ.get("TEC_TEST_KILL_RANK", "1"))
    real = userbuffers.CommOverlap._exchange

    def exchange(comms, tp_group, **kw):
        if rank == victim and comms:
            print(f"rank {rank} created, pid {os.getpid()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(comms, tp_group, **kw)

    userbuffers.CommOverlap._exchange = staticmethod(exchange)
    try:
        tec.initialize_ub((tp * 8, 16), tp, dtype=torch.float32, tp_group=dist.group.WORLD, timeout=10)
    except Exception as e:  # the survivor: the dead peer is an error, not a hang
        print(f"rank {rank}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        os._exit(3)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
