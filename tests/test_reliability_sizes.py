"""Size arithmetic and integers crossing the binding (issue: no input
reaches a signal). Each case runs in a subprocess: before the checks these
inputs wrapped size computations (SIGSEGV) or were truncated silently."""
import pytest

from reliability_util import assert_clean, run_isolated

# Each snippet must raise the named exception with a message matching `match`.
CASES = [
    ("CommOverlap((2**61 - 1,), torch.float32, tp_size=1)", "ValueError", "communicator buffer holds at most"),
    ("_C.norm_bwd_workspace_bytes(-1, -5, -5)", "ValueError", r"argument 1 \(rows\) must be in"),
    ("_C.norm_bwd_workspace_bytes(-1, 2**62, 2**62)", "ValueError", "too large"),
    ("_C.norm_fwd(-1, 2**32, 4, 4, 1, 1, None, 1, None, 1, 1e-5, 0, 0)", "ValueError", r"\(dtype\) must be in \[0, 2\]"),
    ("_C.gemm_workspace_bytes(2**32 - 1)", "ValueError", r"\(device\) must be in \[-1, 65535\]"),
    ("_C.CommOverlap()._create(0, -1, 0, 2**32 + 1, 1024, 'x', 1.0)", "ValueError", r"\(tp_size\) must be in \[1, 16\]"),
    ("_C.CommOverlap()._create(0, -1, 0, 1, 2**63 - 4, 'x', 1.0)", "ValueError", "is too large"),
    ("_C.CommOverlap()._create(0, -1, 0, 1, 2**64, 'x', 1.0)", "OverflowError", "signed 64-bit"),
    ("_C.CommOverlap()._create(0, -1, 0, 1, -8, 'x', 1.0)", "ValueError", r"\(buffer_bytes\) must be in"),
    ("_C.gemm(-1, 0, 0, 0, 0, 2**31, 2**31, 2**31, 1, 2**31, 1, 2**31, 1, 2**31, None, None, 0, None, 0, None)",
     "ValueError", "byte count overflows"),
    ("_C.gemm(-1, 0, 0, 2, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, None, None, 0, None, 0, None)", "ValueError",
     r"\(transa\) must be in \[0, 1\]"),
    ("_C.gemm(-1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, None, None, 0, None, -1, None)", "ValueError",
     r"\(workspace_bytes\) must be in"),
    ("_C.gemm(-1, 0, 0, 0, 0, 1, 1, 1, -5, 1, 1, 1, 1, 1, None, None, 0, None, 0, None)", "ValueError",
     r"argument 8 must be an address \(int >= 0\)"),
    ("_C.norm_fwd(-1, 0, 2**40, 2**40, 1, 1, None, 1, None, 1, 1e-5, 0, 0)", "ValueError", "too large"),
    ("_C.norm_fwd(-1, 0, 4, 4, 1, 1, None, 1, None, 1, float('inf'), 0, 0)", "ValueError", r"\(eps\) must be a finite"),
    ("_C.load_cuda_backend('x', -1)", "ValueError", r"\(gemm_policy\) must be in"),
]

PRELUDE = """
import re, torch
from transformer_engine_c import _C, CommOverlap
"""


@pytest.mark.parametrize("expr,exc,match", CASES, ids=[c[0][:60] for c in CASES])
def test_refused_with_clear_exception(expr, exc, match):
    rc, out, err = run_isolated(PRELUDE + f"""
try:
    r = {expr}
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("RETURNED " + repr(r))
""")
    assert_clean(rc, out, err)
    assert out.startswith(exc + ":"), out
    assert re_search(match, out), out


def re_search(pattern, text):
    import re
    return re.search(pattern, text) is not None


# The raw communicator entry points on a 1-rank communicator of 4 KiB:
# chunk sizes whose products wrap modulo 2**64 (rows * k * 4 = 2**66 -> 0)
# used to pass the buffer check and crash in the copy.
RAW_COMM = PRELUDE + """
c = CommOverlap((32, 32), torch.float32, tp_size=1)
w = torch.randn(4, 4, device=c.device)  # the communicator's device (CUDA where there is one)
out = torch.empty(4, 4, device=c.device)
def expect(fn, pattern):
    try:
        fn()
    except (ValueError, OverflowError) as e:
        assert re.search(pattern, str(e)), str(e)
    else:
        raise AssertionError("accepted")
expect(lambda: c._ag_gemm(None, 2**62, 4, 4, 0, 0, w.data_ptr(), 4, 1, out.data_ptr(), 4, None, None, None, -1, -1, 0, 0, 0),
       "buffer too small")
expect(lambda: c._ag_gemm(None, 4, 4, 4, 0, 0, w.data_ptr(), 4, 1, out.data_ptr(), 2**62, None, None, None, -1, -1, 0, 0, 0),
       "too large")
expect(lambda: c._gemm_rs(w.data_ptr(), 2**62, 4, 4, 4, 0, w.data_ptr(), 4, 1, out.data_ptr(), None, None, -1, -1, 0, 0, 0,
                          -1, 0, 0, 0),
       "too large")
expect(lambda: c._bulk_ag_start(None, 2**63 - 1, None), "buffer too small")
expect(lambda: c._bulk_rs_start(w.data_ptr(), 2**62, 2**62, 0, out.data_ptr(), None), "buffer too small")
expect(lambda: c._ag_gemm(None, 4, 4, 4, 0, 2**32, w.data_ptr(), 4, 1, out.data_ptr(), 4, None, None, None, -1, -1, 0, 0, 0),
       r"\\(out_dtype\\) must be in")
expect(lambda: c._set_gemm(None, -1, 0), r"\\(nbytes\\) must be in")
# the communicator still works afterwards
a = torch.randn(8, 4, device=c.device)
y = c.ag_gemm(a, w)
torch.testing.assert_close(y, a @ w.t())
print("OK")
"""


def test_raw_comm_entry_points_refuse_wrapping_sizes():
    rc, out, err = run_isolated(RAW_COMM)
    assert_clean(rc, out, err)
    assert "OK" in out


def test_shape_entries_must_be_ints():
    rc, out, err = run_isolated(PRELUDE + """
for shape in [(4.5, 4), (True, 4), "ab"]:
    try:
        CommOverlap(shape, torch.float32, tp_size=1)
    except TypeError as e:
        assert "shape must be a sequence of ints" in str(e), str(e)
    else:
        raise AssertionError(f"{shape} accepted")
print("OK")
""")
    assert_clean(rc, out, err)
    assert "OK" in out
