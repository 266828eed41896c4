"""The layers' fast path under sequence parallelism (no userbuffers) equals
the general path bit for bit, on 2 CPU ranks (gloo)."""
from launch import run_torchrun


def test_fast_path_sequence_parallel_cpu():
    run_torchrun("run_fast_sp.py", 2)
