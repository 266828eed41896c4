"""The CUDA IPC transport's own test program (tests/cuda/transport_test.cu):
built with nvcc wherever there is one (so a source missing from its build
fails at the link on a CPU machine too) and run where there is a GPU."""
import importlib.util
import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("transport_build", os.path.join(ROOT, "tests", "cuda", "transport_build.py"))
transport_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(transport_build)


def test_cuda_transport_program(tmp_path):
    if transport_build.find_nvcc() is None:
        pytest.skip("no nvcc on this machine to build the transport test with")
    exe = str(tmp_path / "transport_test")
    built = transport_build.build(exe)
    assert built.returncode == 0, built.stdout[-4000:]
    if not torch.cuda.is_available():
        pytest.skip("built; no CUDA GPU on this machine to run it (GPU tests run on the GPU machines)")
    proc = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "PASS transport_test" in proc.stdout, proc.stdout[-4000:]
