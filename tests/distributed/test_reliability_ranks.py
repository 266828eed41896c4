"""Misuse on 2 CPU ranks leaves the communicator usable (run_reliability.py);
threads sharing an overlapped layer get right outputs (run_threads_layer.py)."""
from launch import run_torchrun


def test_misuse_refused_before_state_change_cpu():
    run_torchrun("run_reliability.py", 2, timeout=240)


def test_threads_share_overlapped_layer_cpu():
    """Two threads sharing an overlapped LayerNormLinear on 2 ranks: every
    output right (the layers hold their communicators across the sequences
    that belong together: norm into the slot + ag_gemm, a backward's bulk
    start ... finish)."""
    run_torchrun("run_threads_layer.py", 2, timeout=240)
