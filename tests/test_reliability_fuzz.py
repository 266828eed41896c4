"""Property-based fuzz (hypothesis) of the raw _C entry points and the
public API: whatever the integers, codes, sizes and shapes, a
call returns or raises a clear Python exception; it never kills the
process and never returns a wrong product. Calls run in a long-lived
worker subprocess (tests/fuzz_worker.py): a crash is a test failure that
names the call."""
import json
import os
import subprocess
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the test extras (pip install .[test])")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from reliability_util import ROOT  # noqa: E402

ALLOWED = ("TypeError", "ValueError", "OverflowError", "MemoryError", "EngineError", "RuntimeError")

EXTREME = [-1, -5, -(2 ** 31), 2 ** 31, 2 ** 32, 2 ** 32 - 1, 2 ** 32 + 1, 2 ** 61 - 1, 2 ** 62, 2 ** 63 - 1,
           2 ** 63, 2 ** 64, -(2 ** 63), -(2 ** 64)]
small = st.integers(0, 8)
size = st.one_of(small, small, st.sampled_from(EXTREME))
code = st.one_of(st.integers(-1, 3), st.sampled_from(EXTREME))
flag = st.one_of(st.integers(0, 1), st.sampled_from([2, -1, 2 ** 32]))
ptr = st.sampled_from(["P", "P", "P", None, 0, -8])
junk = st.sampled_from([None, "x", 1.5, [], True])
any_int = st.one_of(size, junk)
real = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-5, 0.0]))


class Worker:
    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fuzz_worker.py")], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def call(self, c):
        line = json.dumps(c)
        try:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
            out = self.p.stdout.readline()
        except BrokenPipeError:
            out = ""
        if not out:
            rc = self.p.wait(timeout=30)
            err = self.p.stderr.read()[-2000:]
            global _worker
            _worker = None
            raise AssertionError(f"the worker died (exit status {rc}) on {line}\n{err}")
        res = json.loads(out)
        assert not res.startswith("WRONG"), f"{line}: {res}"
        assert res == "ok" or res.split(" ", 1)[0] in ALLOWED, f"{line}: unexpected {res}"
        return res


_worker = None


def worker():
    global _worker
    if _worker is None:
        _worker = Worker()
    return _worker


FAST = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FAST
@given(st.tuples(code, code, any_int, size, ptr, ptr, ptr, ptr, ptr, ptr, real, flag, ptr))
def test_raw_norm_fwd(args):
    worker().call({"fn": "norm_fwd", "args": list(args)})


@FAST
@given(st.tuples(code, code, size, size, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, flag, ptr, size, ptr))
def test_raw_norm_bwd(args):
    worker().call({"fn": "norm_bwd", "args": list(args)})


@FAST
@given(st.tuples(code, any_int, any_int))
def test_raw_norm_bwd_workspace_bytes(args):
    worker().call({"fn": "norm_bwd_workspace_bytes", "args": list(args)})


@FAST
@given(st.tuples(code, code, code, flag, flag, size, size, size, ptr, size, ptr, size, ptr, size, ptr, ptr, flag,
                 ptr, size, ptr))
def test_raw_gemm(args):
    worker().call({"fn": "gemm", "args": list(args)})


@FAST
@given(st.tuples(code, code, code, code, st.one_of(size, st.integers(1, 1 << 16)),
                 st.one_of(st.text(max_size=8), junk), real))
def test_raw_comm_create(args):
    worker().call({"fn": "create", "args": list(args)})


@FAST
@given(st.tuples(ptr, size, size, size, code, code, ptr, size, flag, ptr, size, ptr, ptr, ptr))
def test_raw_ag_gemm(args):
    worker().call({"fn": "_ag_gemm", "args": list(args)})


@FAST
@given(st.tuples(ptr, size, size, size, size, code, ptr, size, flag, ptr, ptr, ptr))
def test_raw_gemm_rs(args):
    worker().call({"fn": "_gemm_rs", "args": list(args)})


@FAST
@given(st.one_of(st.tuples(ptr, size, ptr).map(lambda t: ("_bulk_ag_start", t)),
                 st.tuples(ptr, size, size, code, ptr, ptr).map(lambda t: ("_bulk_rs_start", t))))
def test_raw_bulk(fa):
    fn, args = fa
    worker().call({"fn": fn, "args": list(args)})


dims = st.lists(st.one_of(st.integers(-2, 6), st.sampled_from([2 ** 40, 2 ** 61 - 1])), min_size=0, max_size=3)


@FAST
@given(dims, st.sampled_from(["f32", "bf16", "f16", "int8"]),
       st.fixed_dictionaries({}, optional={"name": st.one_of(st.text(max_size=4), junk),
                                           "timeout": st.one_of(real, junk)}))
def test_public_comm_overlap(shape, dt, kw):
    worker().call({"fn": "CommOverlap", "args": [shape, dt, kw]})


@FAST
@given(st.fixed_dictionaries({}, optional={"shape": dims, "local_chunk": st.booleans(),
                                           "dtype": st.just(None)}))
def test_public_get_buffer(kw):
    worker().call({"fn": "get_buffer", "kw": kw})


mat = st.tuples(st.tuples(st.integers(0, 5), st.integers(0, 5)), st.sampled_from(["f32", "bf16"]))


@FAST
@given(mat, mat, st.booleans())
def test_public_gemm_matches_torch(a, b, transb):
    worker().call({"fn": "engine_gemm", "a": a, "b": b, "transb": transb})


@FAST
@given(st.tuples(st.integers(0, 8), st.integers(0, 70)), st.tuples(st.integers(0, 6), st.integers(0, 70)),
       st.sampled_from(["f32", "bf16"]))
def test_public_ag_gemm(a, w, dt):
    worker().call({"fn": "ag_gemm", "a": [list(a), dt], "w": [list(w), dt]})


def teardown_module(module):
    """End the worker (its stdin closing ends its loop)."""
    global _worker
    if _worker is not None:
        _worker.p.stdin.close()
        _worker.p.wait(timeout=30)
        _worker.p.stdout.close()
        _worker.p.stderr.close()
        _worker = None
