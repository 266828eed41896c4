"""Grad mode never switches an overlap off (no_grad, inference_mode, reentrant
and non-reentrant checkpointing), proven by the communicators' counters."""
import pytest

from launch import gpu_count, run_torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_grad_mode_overlap_cpu(nproc):
    run_torchrun("run_grad_mode_overlap.py", nproc, ["--device", "cpu"], timeout=300)


@pytest.mark.parametrize("nproc", [2, 4])
def test_grad_mode_overlap_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {gpu_count()}")
    run_torchrun("run_grad_mode_overlap.py", nproc, ["--device", "cuda"], timeout=300)
