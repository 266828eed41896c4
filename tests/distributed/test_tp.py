"""Tensor parallel layers under torchrun (gloo on CPU, nccl on GPUs)."""
import pytest

from launch import gpu_count, run_torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_cpu(nproc):
    run_torchrun("run_tp.py", nproc, ["--device", "cpu"])


@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {gpu_count()}")
    run_torchrun("run_tp.py", nproc, ["--device", "cuda"])
