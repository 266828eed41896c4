"""DistributedWeight in Linear / LayerNormLinear under torchrun (gloo, CPU):
hooks, offloading and checkpointing against a plain full weight. The runner
is tests/distributed/run_distributed_weight.py."""
import os
import subprocess
import sys

import pytest

from launch import HERE, ROOT, free_port, gpu_count, run_torchrun


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
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.join(HERE, "run_distributed_weight.py"),
           "--no-keep-references"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "PASS run_distributed_weight" not in proc.stdout
