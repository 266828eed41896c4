"""The CUDA IPC transport's own test program (tests/cuda/transport_test.cu):
built with nvcc and run where there is a GPU."""
import os
import shutil
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cuda_transport_program(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine (GPU tests run on the GPU machines)")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.skip("a GPU but no nvcc to build the transport test with")
    exe = str(tmp_path / "transport_test")
    subprocess.run([nvcc, "-std=c++17", "-O2", "-gencode=arch=compute_90,code=sm_90", "-I",
                    os.path.join(ROOT, "csrc", "core"), os.path.join(ROOT, "tests", "cuda", "transport_test.cu"),
                    os.path.join(ROOT, "csrc", "core", "cuda", "cuda_transport.cu"),
                    os.path.join(ROOT, "csrc", "core", "cuda", "transport_reduce.cu"),
                    os.path.join(ROOT, "csrc", "core", "cuda", "cuda_common.cu"),
                    os.path.join(ROOT, "csrc", "core", "error.c"), "-o", exe, "-lcudart"],
                   check=True, timeout=300)
    proc = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "PASS transport_test" in proc.stdout, proc.stdout[-4000:]
