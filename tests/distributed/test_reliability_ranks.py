"""Misuse on 2 CPU ranks leaves the communicator usable (run_reliability.py)."""
from launch import run_torchrun


def test_misuse_refused_before_state_change_cpu():
    run_torchrun("run_reliability.py", 2, timeout=240)
