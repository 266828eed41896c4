"""The CUDA GEMM's plan cache (csrc/core/cuda/gemm_plan.cu): more shapes than it holds
evict the least recently used plans and every result stays right; a shape used again
after eviction is rebuilt, a recent one is found; threads enqueueing GEMMs with fused
bias epilogues at once (no lock held across the enqueue, a descriptor per call) each
get their own bias. GPU only; each check runs in a fresh process (fresh counters)."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU on this machine (the plan cache is cuBLASLt's)")

_EVICT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_kernels import _gemm_stats, rand, gemm_ref, poison, TOL, rel_err, _engine
dt, dev = torch.float32, "cuda"
shapes = [(8 + i, 16, 32) for i in range(300)]  # 300 keys: more than the 256 plans kept
inputs = {s: (rand(s[0], s[2], dtype=dt, device=dev), rand(s[2], s[1], dtype=dt, device=dev)) for s in shapes}

def run(s):
    a, b = inputs[s]
    y = _engine.gemm(a, b, out=poison(torch.empty(s[0], s[1], dtype=dt, device=dev)))
    assert rel_err(y, gemm_ref(a, b, False, False)) < TOL[dt], s

s0 = _gemm_stats()
for s in shapes:
    run(s)
s1 = _gemm_stats()
assert s1[3] - s0[3] == len(shapes), (s0, s1)
assert s1[7] - s0[7] == len(shapes) - 256, ("evictions", s0, s1)
run(shapes[-1])              # recent: found
s2 = _gemm_stats()
assert s2[3] == s1[3] and s2[7] == s1[7], (s1, s2)
run(shapes[0])               # evicted long ago: rebuilt, evicting another
s3 = _gemm_stats()
assert s3[3] == s2[3] + 1 and s3[7] == s2[7] + 1, (s2, s3)
print("OK", s3)
"""

_THREADS = r"""
import sys, threading, torch
sys.path.insert(0, sys.argv[1])
from test_kernels import _gemm_stats, rand, gemm_ref, TOL, rel_err, _engine
from transformer_engine_c import _C
dt, dev = torch.bfloat16, torch.device("cuda", 0)
_engine.device_code(dev)  # loads the CUDA backend (the raw _C calls below do not)
m, n, k, nthreads, iters = 256, 384, 512, 4, 40
a = rand(m, k, dtype=dt, device=dev)
w = rand(n, k, dtype=dt, device=dev)
nbytes = _C.gemm_workspace_bytes(0)
base = gemm_ref(a, w, False, True)
errors = []
s0 = _gemm_stats()

def worker(t):
    try:
        stream = torch.cuda.Stream(device=dev)
        bias = rand(n, dtype=dt, device=dev, offset=float(t))  # each thread its own bias
        ws = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        outs = [torch.full((m, n), float("nan"), dtype=dt, device=dev) for _ in range(iters)]
        torch.cuda.synchronize()
        for y in outs:
            _C.gemm(0, 1, 1, 0, 1, m, n, k, a.data_ptr(), k, w.data_ptr(), k, y.data_ptr(), n,
                    bias.data_ptr(), None, 0, ws.data_ptr(), nbytes, stream.cuda_stream)
        stream.synchronize()
        ref = base + bias.double().cpu()
        for y in outs:
            e = rel_err(y, ref)
            if not e < TOL[dt]:
                errors.append((t, e))
                break
    except Exception as ex:  # reported below
        errors.append((t, repr(ex)))

threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
for th in threads:
    th.start()
for th in threads:
    th.join()
assert not errors, errors
s1 = _gemm_stats()
assert s1[0] - s0[0] == nthreads * iters, ("not the fused epilogue", s0, s1)
print("OK", s1)
"""


def _run(code):
    r = subprocess.run([sys.executable, "-c", code, HERE], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_plan_cache_evicts_least_recently_used():
    _run(_EVICT)


def test_threads_with_fused_bias_each_get_their_own():
    _run(_THREADS)
