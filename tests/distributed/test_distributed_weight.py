"""DistributedWeight in Linear / LayerNormLinear under torchrun (gloo, CPU):
hooks, offloading and checkpointing against a plain full weight. The runner
is tests/distributed/run_distributed_weight.py."""
import pytest

from launch import gpu_count, run_torchrun, torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_distributed_weight(nproc):
    out = run_torchrun("run_distributed_weight.py", nproc, timeout=300)
    assert f"{nproc} ranks" in out


@pytest.mark.parametrize("nproc", [2, 4])
def test_distributed_weight_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {gpu_count()}")
    out = run_torchrun("run_distributed_weight.py", nproc, ["--device", "cuda"], timeout=300)
    assert f"{nproc} ranks, cuda" in out


def test_distributed_weight_negative():
    """Keep-by-reference switched off: the same runner must fail (the backward
    gets the plain shard that the hooks unpacked)."""
    proc = torchrun("run_distributed_weight.py", 2, ["--no-keep-references"], timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "PASS run_distributed_weight" not in proc.stdout
