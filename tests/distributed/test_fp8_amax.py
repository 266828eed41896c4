"""FP8 amax reductions over gloo with 2 ranks (run_fp8_amax.py)."""
from launch import run_torchrun


def test_fp8_amax_reductions_two_ranks():
    run_torchrun("run_fp8_amax.py", 2, timeout=180)
