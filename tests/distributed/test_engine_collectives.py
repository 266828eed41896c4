"""The engine's own NCCL communicator on 2 ranks gives the process group's
bits (collectives, the sequence-parallel layers, CUDA graph replays):
tests/distributed/run_engine_collectives.py. One-rank checks, the watchdog
and the creation timeout: tests/test_engine_nccl.py."""
import pytest

from launch import gpu_count, run_torchrun


def test_engine_collectives_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (or one with TEC_SHARE_GPU=2), this machine has {gpu_count()}")
    run_torchrun("run_engine_collectives.py", 2)


def test_engine_id_exchange_cpu():
    """The part of making the engine's communicator that needs two ranks and
    no GPU: every rank gets its group's rank 0 id (tests/distributed/run_engine_id.py)."""
    run_torchrun("run_engine_id.py", 2)
