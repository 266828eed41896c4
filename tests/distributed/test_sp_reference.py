"""The layers under sequence parallelism (with and without userbuffers
communicators that fall back or overlap) against a float64 reference of the
whole layer, on 2 ranks: CPU (gloo) and CUDA (NCCL)."""
import pytest

from launch import gpu_count, run_torchrun


def test_sequence_parallel_against_reference_cpu():
    run_torchrun("run_sp_reference.py", 2, ["--device", "cpu"])


def test_sequence_parallel_against_reference_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {gpu_count()}")
    run_torchrun("run_sp_reference.py", 2, ["--device", "cuda"])
