"""TransformerLayer under torchrun (tensor parallelism with and without
sequence parallelism, userbuffers overlap): run_transformer_layer_tp.py must
exit 0 and print its pass line."""
import pytest

from launch import gpu_count, run_torchrun


def test_transformer_layer_tp_cpu():
    run_torchrun("run_transformer_layer_tp.py", 2, ["--device", "cpu"], timeout=600)


def test_transformer_layer_tp_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA ranks (2 GPUs, or TEC_SHARE_GPU=2 on one), this machine has {gpu_count()}")
    run_torchrun("run_transformer_layer_tp.py", 2, ["--device", "cuda"], timeout=600)
