"""LayerNormMLP under torchrun (tensor + sequence parallel, every activation,
both norms, the userbuffers flag combinations, every grad mode,
DistributedWeight): run_layernorm_mlp.py must exit 0 and print its pass line."""
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
