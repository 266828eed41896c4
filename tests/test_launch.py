"""A rank's CUDA device (transformer_engine_c._launch.cuda_index): its own
GPU, or with TEC_SHARE_GPU=N a shared one, NCCL told that each rank is its
own host. CPU only: torch.cuda.device_count is replaced."""
import os

import pytest
import torch

from transformer_engine_c import _launch

NCCL_ENV = ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE")


@pytest.fixture
def gpus(monkeypatch):
    """Set how many GPUs torch reports; NCCL's variables start unset."""
    for k in NCCL_ENV + ("TEC_SHARE_GPU",):
        monkeypatch.delenv(k, raising=False)

    def set_count(n):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


def test_own_gpu_per_rank(gpus):
    gpus(2)
    assert [_launch.cuda_index(r) for r in (0, 1)] == [0, 1]
    assert not any(k in os.environ for k in NCCL_ENV)  # nothing told to NCCL


def test_rank_without_gpu_is_refused(gpus):
    gpus(1)
    with pytest.raises(RuntimeError, match="local rank 1 has no GPU of its own.*TEC_SHARE_GPU"):
        _launch.cuda_index(1)


def test_shared_gpu(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("TEC_SHARE_GPU", "2")
    assert _launch.cuda_index(1) == 0
    host1 = os.environ["NCCL_HOSTID"]
    monkeypatch.delenv("NCCL_HOSTID")
    assert _launch.cuda_index(0) == 0
    assert os.environ["NCCL_HOSTID"] != host1  # each rank its own host to NCCL
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_IB_DISABLE"] == "1"


def test_shared_keeps_a_users_nccl_settings(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("TEC_SHARE_GPU", "4")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    assert [_launch.cuda_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert os.environ["NCCL_SOCKET_IFNAME"] == "eth0"


@pytest.mark.parametrize("value, words", [("0", "positive number"), ("two", "positive number")])
def test_bad_share_value(gpus, monkeypatch, value, words):
    gpus(1)
    monkeypatch.setenv("TEC_SHARE_GPU", value)
    with pytest.raises(ValueError, match=f"TEC_SHARE_GPU must be a {words}"):
        _launch.cuda_index(0)


def test_share_errors(gpus, monkeypatch):
    monkeypatch.setenv("TEC_SHARE_GPU", "2")
    gpus(1)
    with pytest.raises(RuntimeError, match="local rank 2 but TEC_SHARE_GPU=2"):
        _launch.cuda_index(2)
    gpus(0)
    with pytest.raises(RuntimeError, match="no CUDA GPU is present"):
        _launch.cuda_index(0)
