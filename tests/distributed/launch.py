"""Launch a runner under torchrun from pytest: exit 0 and its pass line are required."""
import os
import socket
import subprocess
import sys

import torch

from transformer_engine_c._launch import shared_gpu_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count():
    """How many CUDA ranks the tests may start: the GPUs present or, with
    TEC_SHARE_GPU=N and a GPU present, N ranks sharing them
    (transformer_engine_c._launch.cuda_index)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(count, shared_gpu_ranks()) if count else 0


def run_torchrun(script, nproc, args=(), timeout=300, pass_line=None):
    """Run tests/distributed/<script> on nproc ranks; return its stdout."""
    proc = torchrun(script, nproc, args, timeout)
    out = proc.stdout
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out[-6000:]}"
    want = pass_line or f"PASS {os.path.splitext(script)[0]}"
    assert want in out, f"{script} printed no '{want}' line:\n{out[-6000:]}"
    return out


def torchrun(script, nproc, args=(), timeout=300):
    """Run tests/distributed/<script> on nproc ranks; the finished process
    (stdout and stderr together in its stdout), whatever its exit status."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.join(HERE, script), *args]
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
