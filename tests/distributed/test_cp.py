"""Context parallelism under torchrun (run_cp.py): DotProductAttention with
every cp_comm_type, format and mask against the whole-sequence attention on
one rank, TransformerLayer with rotary embeddings, bad inputs and a silent
peer; gloo on CPU ranks, NCCL on GPUs (TEC_SHARE_GPU=N ranks may share one)."""
import pytest

from launch import gpu_count, run_torchrun, torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_cp_cpu(nproc):
    out = run_torchrun("run_cp.py", nproc, ["--device", "cpu"], pass_line=f"PASS run_cp (CP={nproc}, cpu)")
    assert "compared 28 attention configurations" in out, out[-3000:]


def test_cp_checker_catches_a_wrong_layout():
    """Inputs sharded as contiguous slices, not the balanced chunks: the
    comparison must fail."""
    proc = torchrun("run_cp.py", 2, ["--break-layout"])
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "p2p sbhd causal fp32 h4/4 d8/8 window None: output: relative error" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("nproc", [2, 4])
def test_cp_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA ranks (GPUs, or TEC_SHARE_GPU={nproc}), this machine has {gpu_count()}")
    run_torchrun("run_cp.py", nproc, ["--device", "cuda"], pass_line=f"PASS run_cp (CP={nproc}, cuda)")
