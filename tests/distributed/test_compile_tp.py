"""The tensor-parallel layers compiled with fullgraph, with and without
userbuffers, against the eager layers (bit for bit) under torchrun."""
import pytest

from launch import gpu_count, run_torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_compile_tp_cpu(nproc):
    run_torchrun("run_compile_tp.py", nproc, ["--device", "cpu"], timeout=600)


@pytest.mark.parametrize("nproc", [2])
def test_compile_tp_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs (or TEC_SHARE_GPU={nproc} on one), this machine has {gpu_count()}")
    run_torchrun("run_compile_tp.py", nproc, ["--device", "cuda"], timeout=600)
