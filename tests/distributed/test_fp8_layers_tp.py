"""The three layers in FP8 under tensor and sequence parallelism against the
unsharded layer in FP8, on 2 ranks: CPU (gloo, the exact emulation) and CUDA
(NCCL; two ranks may share one GPU with TEC_SHARE_GPU=2); per-tensor recipes
and Float8BlockScaling."""
import pytest

from launch import gpu_count, run_torchrun


def test_fp8_layers_tensor_parallel_cpu():
    run_torchrun("run_fp8_layers.py", 2, ["--device", "cpu"])


def test_fp8_layers_tensor_parallel_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA ranks (2 GPUs, or TEC_SHARE_GPU=2 on one), this machine has {gpu_count()}")
    run_torchrun("run_fp8_layers.py", 2, ["--device", "cuda"])


def test_fp8_block_scaling_layers_tensor_parallel_cpu():
    run_torchrun("run_fp8_layers.py", 2, ["--device", "cpu", "--recipes", "block"])


def test_fp8_block_scaling_layers_tensor_parallel_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA ranks (2 GPUs, or TEC_SHARE_GPU=2 on one), this machine has {gpu_count()}")
    run_torchrun("run_fp8_layers.py", 2, ["--device", "cuda", "--recipes", "block"])
