"""One error channel: a failure in either shared library (_C's core, or the CUDA
library libtec_cuda.so, which reports through the hooks the core hands it on load)
reaches Python with its own message (file:line of the CUDA call that failed), and
the same failure is the same exception wherever it happens (out of memory is
MemoryError from the CPU transport, the CUDA transport and the CUDA backend alike).
The CUDA-library checks load it in a child process (loading is for the life of a
process) and run wherever it was built, with or without a GPU."""
import os
import subprocess
import sys

import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c import _C, _engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_transport_out_of_memory_is_memory_error():
    c = _C.CommOverlap()
    # 128 TiB: more than the memory available, refused before anything is reserved
    with pytest.raises(MemoryError, match=r"a region of \d+ bytes \(\d+\.\d MiB\) is more than the memory available"):
        c._create(0, -1, 0, 1, 1 << 46, "huge", 1.0)


_CHILD = r"""
import sys, torch
from transformer_engine_c import _C, _engine
import transformer_engine_c as tec
try:
    _C.load_cuda_backend(_engine._CUDA_LIB, 0)
except Exception as e:
    print("SKIP cannot load the CUDA library here:", e)
    sys.exit(0)
# A device that does not exist: the backend fails inside libtec_cuda.so.
try:
    _C.gemm(99, 0, 0, 0, 0, 4, 4, 4, 256, 4, 256, 4, 256, 4, None, None, 0, 256,
            _C.gemm_workspace_bytes(99), 0)
    raise SystemExit("gemm on cuda:99 succeeded")
except tec.EngineError as e:
    msg = str(e)
    assert "gemm.cu:" in msg and "cuda:99" in msg, msg
# The transport fails inside libtec_cuda.so too (reached through the backend table).
c = _C.CommOverlap()
try:
    c._create(1, 99, 0, 1, 1 << 20, "nodev", 1.0)
    raise SystemExit("a communicator on cuda:99 was created")
except (ValueError, tec.EngineError) as e:
    assert "cuda_transport.cu:" in str(e), e
if torch.cuda.is_available():
    # Out of device memory: MemoryError, as from the CPU transport.
    c = _C.CommOverlap()
    try:
        c._create(1, 0, 0, 1, 1 << 46, "huge", 1.0)
        raise SystemExit("a 128 TiB CUDA communicator was created")
    except MemoryError as e:
        assert "cudaErrorMemoryAllocation" in str(e), e
    print("checked out of memory on cuda:0")
print("OK")
"""


def test_cuda_library_reports_through_the_core():
    if not _engine.cuda_backend_built():
        pytest.skip("the CUDA library was not built (TEC_CUDA=1 builds it where nvcc and cuBLASLt are)")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout + r.stderr
    if r.returncode == 0 and out.startswith("SKIP"):
        pytest.skip(out.strip())
    assert r.returncode == 0 and "OK" in r.stdout, out[-3000:]
    if torch.cuda.is_available():
        assert "checked out of memory" in r.stdout, out[-3000:]
