"""LayerNormMLP under torchrun (tensor + sequence parallel, every activation,
both norms, the userbuffers flag combinations, every grad mode,
DistributedWeight; and in FP8 with userbuffers): run_layernorm_mlp.py must exit 0 and print its
pass line."""
import pytest

from launch import gpu_count, run_torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_layernorm_mlp_cpu(nproc):
    run_torchrun("run_layernorm_mlp.py", nproc, ["--device", "cpu"], timeout=600)


@pytest.mark.parametrize("nproc", [2, 4])
def test_layernorm_mlp_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {gpu_count()}")
    run_torchrun("run_layernorm_mlp.py", nproc, ["--device", "cuda"], timeout=600)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_layernorm_mlp_fp8_overlap_cpu(recipe):
    """FP8 with every userbuffers flag combination and grad mode against the
    module without userbuffers, in FP8 (the FP8 communicators' stats prove
    the overlapped paths ran)."""
    run_torchrun("run_layernorm_mlp.py", 2, ["--device", "cpu", "--fp8", recipe], timeout=600)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_layernorm_mlp_fp8_overlap_cuda(recipe):
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA ranks (2 GPUs, or TEC_SHARE_GPU=2 on one), this machine has {gpu_count()}")
    run_torchrun("run_layernorm_mlp.py", 2, ["--device", "cuda", "--fp8", recipe], timeout=600)


def test_layernorm_mlp_fp8_buf_cpu():
    """bf16 under DelayedScaling with fc2_fprop's fp8_buf: fc2's reduce-scatter
    sends FP8 partials in every grad mode (its bytes counted), within TE's FP8
    tolerances of the module without userbuffers, under the saved-tensor
    checker."""
    run_torchrun("run_layernorm_mlp.py", 2, ["--device", "cpu", "--fp8", "delayed", "--fp8-buf"], timeout=600)


def test_layernorm_mlp_fp8_buf_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA ranks (2 GPUs, or TEC_SHARE_GPU=2 on one), this machine has {gpu_count()}")
    run_torchrun("run_layernorm_mlp.py", 2, ["--device", "cuda", "--fp8", "delayed", "--fp8-buf"], timeout=600)
