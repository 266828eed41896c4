"""The layers' fast path under sequence parallelism (no userbuffers, or
communicators that fall back) equals the general path bit for bit, on 2
ranks: CPU (gloo) and CUDA (NCCL)."""
import pytest

from launch import gpu_count, run_torchrun


def test_fast_path_sequence_parallel_cpu():
    run_torchrun("run_fast_sp.py", 2, ["--device", "cpu"])


def test_fast_path_sequence_parallel_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {gpu_count()}")
    run_torchrun("run_fast_sp.py", 2, ["--device", "cuda"])
