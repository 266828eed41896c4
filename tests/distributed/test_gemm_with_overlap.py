"""The overlap schedules (AG+GEMM, GEMM+RS, bulk) and their failure paths
under torchrun on CPU (gloo + the shared-memory transport)."""
import pytest

from launch import gpu_count, run_torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_gemm_with_overlap(nproc):
    run_torchrun("run_gemm_with_overlap.py", nproc, ["--check", "numerics,fp8_partials,registry,mismatch,small,lifetime,close"], timeout=240,
                 pass_line="PASS run_gemm_with_overlap")


@pytest.mark.parametrize("nproc", [2, 4])
def test_comm_timeout(nproc):
    out = run_torchrun("run_gemm_with_overlap.py", nproc, ["--check", "timeout"], timeout=120,
                       pass_line="PASS run_gemm_with_overlap")
    assert "ok timeout" in out


@pytest.mark.parametrize("nproc", [2, 4])
def test_gemm_with_overlap_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {gpu_count()}")
    run_torchrun("run_gemm_with_overlap.py", nproc, ["--device", "cuda", "--check", "numerics,fp8_partials,registry,mismatch,small,lifetime,close,timeout"],
                 timeout=300, pass_line="PASS run_gemm_with_overlap")
