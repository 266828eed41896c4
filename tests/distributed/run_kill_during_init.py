"""Rank $TEC_TEST_KILL_RANK sends itself signal $TEC_TEST_KILL_SIGNAL at
stage $TEC_TEST_KILL_STAGE of initialize_ub:
  creating  between creating two of its communicators (the third _create),
  created   when its communicators exist, before the handles are exchanged,
  mapped    when every peer has mapped its regions, before the descriptors
            are closed (the first _release_handle).
Every rank first prints its pid; the victim prints how many region
descriptors it holds as it dies. The others fail with an error (a dead peer)
or are ended by torchrun; tests/test_reliability_shm.py then checks that
nothing is left once every process has exited.
    TEC_TEST_KILL_RANK=0 TEC_TEST_KILL_SIGNAL=SIGTERM TEC_TEST_KILL_STAGE=created \
        torchrun --nproc_per_node=2 tests/distributed/run_kill_during_init.py
"""
import os
import signal
import sys

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c import userbuffers
from transformer_engine_c._launch import init_rank


def region_fds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tec-region")
        except OSError:
            pass
    return n


def main():
    rank, tp, _ = init_rank("cpu")
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    dist.barrier()  # every rank has said its pid before any dies
    victim = int(os.environ["TEC_TEST_KILL_RANK"])
    sig = getattr(signal, os.environ["TEC_TEST_KILL_SIGNAL"])
    stage = os.environ["TEC_TEST_KILL_STAGE"]
    calls = {"_create": 0}

    def die():
        print(f"rank {rank} dies at {stage} holding {region_fds()} region descriptors", flush=True)
        os.kill(os.getpid(), sig)

    cls = userbuffers.CommOverlap
    create, exchange, release = cls._create, cls._exchange, cls._release_handle

    def _create(self, *a):
        calls["_create"] += 1
        if rank == victim and stage == "creating" and calls["_create"] == 3:
            die()
        return create(self, *a)

    def _exchange(comms, tp_group, **kw):
        if rank == victim and stage == "created" and comms:
            die()
        return exchange(comms, tp_group, **kw)

    def _release_handle(self):
        if rank == victim and stage == "mapped":
            die()
        return release(self)

    cls._create, cls._exchange, cls._release_handle = _create, staticmethod(_exchange), _release_handle
    try:
        tec.initialize_ub((tp * 8, 16), tp, dtype=torch.float32, tp_group=dist.group.WORLD, timeout=10)
    except Exception as e:  # the survivor: the dead peer is an error, not a hang
        print(f"rank {rank}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        os._exit(3)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
