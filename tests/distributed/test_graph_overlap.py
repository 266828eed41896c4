"""Userbuffers overlap inside CUDA graphs on two ranks (runner:
run_graph_overlap.py). Needs one CUDA GPU: with one, both ranks share it."""
import pytest

from launch import gpu_count, run_torchrun


@pytest.mark.skipif(gpu_count() < 1, reason="no CUDA GPU on this machine (CUDA graphs run on the GPU machines)")
def test_graphs_with_overlap_replay_as_eager_cuda():
    out = run_torchrun("run_graph_overlap.py", 2, timeout=600)
    assert "bit-identical to eager on 2 ranks" in out, out[-3000:]
