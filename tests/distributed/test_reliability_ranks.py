"""Misuse on 2 CPU ranks leaves the communicator usable (run_reliability.py);
two threads sharing an overlapped layer: right outputs when they take turns,
an error on every rank when they call at once (run_threads_layer.py)."""
from launch import run_torchrun


def test_misuse_refused_before_state_change_cpu():
    run_torchrun("run_reliability.py", 2, timeout=240)


def test_threads_taking_turns_on_an_overlapped_layer_cpu():
    """Two threads sharing an overlapped LayerNormLinear on 2 ranks, one call
    each in turn in the same order everywhere: every output right (the layers
    hold their communicators across the sequences that belong together: norm
    into the slot + ag_gemm, a backward's bulk start ... finish)."""
    run_torchrun("run_threads_layer.py", 2, args=("turns",), timeout=240, pass_line="PASS run_threads_layer turns")


def test_threads_at_once_on_an_overlapped_layer_raise_cpu():
    """Two threads calling one overlapped layer at the same time on 2 ranks:
    the second thread in is refused (naming the communicator and both
    threads), every rank raises, and no thread returns a wrong output without
    an error after it."""
    out = run_torchrun("run_threads_layer.py", 2, args=("at-once",), timeout=240,
                       pass_line="PASS run_threads_layer at-once")
    assert out.count("PASS run_threads_layer at-once") == 2, out[-4000:]
