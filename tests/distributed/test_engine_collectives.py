"""The engine's own NCCL communicator on 2 ranks gives the process group's
bits (collectives, the sequence-parallel layers, CUDA graph replays):
tests/distributed/run_engine_collectives.py; its watchdog ends a rank whose
peer stopped, naming the collective: run_engine_missing_peer.py. One-rank
checks, the watchdog and the creation timeout: tests/test_engine_nccl.py."""
import re
import time

import pytest

from launch import gpu_count, run_torchrun, torchrun


def test_engine_collectives_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (or one with TEC_SHARE_GPU=2), this machine has {gpu_count()}")
    run_torchrun("run_engine_collectives.py", 2)


def test_engine_watchdog_names_a_missing_peer_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (or one with TEC_SHARE_GPU=2), this machine has {gpu_count()}")
    t0 = time.perf_counter()
    proc = torchrun("run_engine_missing_peer.py", 2, timeout=300)
    took, out = time.perf_counter() - t0, proc.stdout
    # the runner's own failure lines start with "FAIL:" (torchrun's report of the
    # rank the watchdog ended says "run_engine_missing_peer.py FAILED", which is expected)
    assert proc.returncode != 0 and not re.search(r"^(\[rank\d\]:)?FAIL:", out, re.M), out[-6000:]
    assert "rank 0: communicator made" in out and "rank 0 enqueued the all-gather rank 1 skips" in out, out[-6000:]
    # fire() in csrc/core/cuda/nccl.cu: which collective, group, rank and device, and the timeout
    assert "NCCL all-gather #2 of the 2-rank group of global ranks [0, 1] (rank 0 of 2, cuda:" in out, out[-6000:]
    assert "(timeout 10.0 s): a peer rank stopped" in out, out[-6000:]
    assert took < 150, f"{took:.0f} s: rank 1 sleeps 60 s after the communicator is made; the watchdog needs 10"


def test_engine_id_exchange_cpu():
    """The part of making the engine's communicator that needs two ranks and
    no GPU: every rank gets its group's rank 0 id (tests/distributed/run_engine_id.py)."""
    run_torchrun("run_engine_id.py", 2)
