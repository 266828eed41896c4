"""The layers' reused temporaries (module/_temporaries.py) give the bits fresh allocations give,
back to back, on several CUDA streams, and from two threads (each on its own
process group), on 2 ranks: CPU (gloo), CUDA (NCCL) and CUDA tensors through
gloo (the ranks may share one GPU). With the
temporaries shared by every thread instead of per thread, the CPU case
fails (every one of three tries, when this test was written)."""
import pytest

from launch import gpu_count, run_torchrun


def test_temporaries_cpu():
    run_torchrun("run_temporaries.py", 2, ["--device", "cpu"])


def test_temporaries_cuda():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {gpu_count()}")
    run_torchrun("run_temporaries.py", 2, ["--device", "cuda"])


def test_temporaries_cuda_gloo():
    """CUDA tensors through gloo: the two ranks may share one GPU."""
    if gpu_count() < 1:
        pytest.skip("needs a CUDA GPU, this machine has none")
    run_torchrun("run_temporaries.py", 2, ["--device", "cuda", "--gloo"])
