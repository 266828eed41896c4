"""Smaller misuses of the communicators: each is a clear error, never a silently
wrong view or a dangling mapping. Snippets that could crash run in a
subprocess."""
import math
import threading

import pytest
import torch

import transformer_engine_c as tec
from reliability_util import assert_clean, run_isolated


def comm():
    return tec.CommOverlap((8, 4), torch.float32, tp_size=1)


def test_get_buffer_refuses_negative_sizes():
    c = comm()
    with pytest.raises(ValueError, match=r"shape must have sizes >= 0 \(no -1"):
        c.get_buffer(shape=(-1, 4))
    with pytest.raises(TypeError, match="shape must be a sequence of ints"):
        c.get_buffer(shape=(2.5, 4))
    assert c.get_buffer(shape=(2, 4)).shape == (2, 4)
    c.close()


@pytest.mark.parametrize("kw,exc,match", [
    ({"name": 5}, TypeError, "name must be a str or None, got int"),
    ({"name": "a\0b"}, ValueError, "name.*contains a NUL character"),
    ({"name": "x" * 200}, ValueError, "at most 95 allowed"),
    ({"timeout": math.inf}, ValueError, r"timeout must be in \(0, 1e\+06\] seconds, got inf"),
    ({"timeout": math.nan}, ValueError, "timeout must be in"),
    ({"timeout": 0}, ValueError, "timeout must be in"),
])
def test_comm_arguments_refused(kw, exc, match):
    with pytest.raises(exc, match=match):
        tec.CommOverlap((8, 4), torch.float32, tp_size=1, **kw)


def test_pins_cannot_be_dropped_by_hand():
    """A view keeps the mapping alive through close(); no call can unmap it
    under the view (the old _unpin() could), and it goes with the view."""
    rc, out, err = run_isolated("""
import gc, torch, transformer_engine_c as tec
c = tec.CommOverlap((8, 4), torch.float32, tp_size=1)
v = c.get_buffer()
assert not hasattr(c, "_unpin"), "_unpin must not exist"
c.close()
assert c.buffer_ranges(), "a live view must keep the region mapped"
v.fill_(3.0)  # would be SIGSEGV on an unmapped region
assert float(v.sum()) == 3.0 * 32
del v
gc.collect()
assert c.buffer_ranges() == [], c.buffer_ranges()
print("OK")
""")
    assert_clean(rc, out, err)
    assert "OK" in out


def test_cpu_gemm_at_flt_max_is_the_rounded_exact_result():
    """Finite inputs near FLT_MAX: the CPU GEMM gives the exact product
    rounded to float32 (inf only where that overflows; never NaN), where a
    float32 accumulator could reach inf - inf = NaN. Compared with a float64
    product cast to float32."""
    from transformer_engine_c import _engine
    F = torch.finfo(torch.float32).max
    g = torch.Generator().manual_seed(0)
    a_all = torch.full((3, 5), F)
    y = _engine.gemm(a_all, torch.ones(2, 5), transb=True)
    assert torch.isinf(y).all() and (y > 0).all()  # like torch: the exact sum overflows
    for _ in range(50):
        m, k, n = (int(v) for v in torch.randint(1, 9, (3,), generator=g))
        a = torch.randn(m, k, generator=g)
        a = torch.where(torch.rand(m, k, generator=g) < 0.5, a, torch.sign(a) * F)
        w = torch.randn(n, k, generator=g)
        y = _engine.gemm(a, w, transb=True)
        exact = (a.double() @ w.double().t()).float()
        assert not y.isnan().any(), (a, w, y)
        assert torch.equal(y, exact) or torch.allclose(y, exact, rtol=1e-6, atol=0), (y, exact)


def test_close_from_two_threads_at_once_is_one_close():
    """close() is idempotent and thread-safe: two threads calling it 500
    times each on one communicator raise nothing, the close's work runs once
    (the checker's registry is told once), and the communicator is destroyed:
    its region unmapped, its comm thread joined, no descriptor left. In a
    subprocess: a double destroy would be a crash there, not pytest's."""
    rc, out, err = run_isolated("""
import gc, os, sys, threading, torch, transformer_engine_c as tec
from transformer_engine_c import debug

def regions():
    with open("/proc/self/maps") as f:
        return f.read().count("/memfd:tec-region")

def resources():
    return regions(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

tec.CommOverlap((8, 4), torch.float32, tp_size=1, device="cpu").close()  # warm up lazy state
gc.collect()
before = resources()
c = tec.CommOverlap((8, 4), torch.float32, tp_size=1, device="cpu", name="closing")
assert regions() > before[0], "the communicator maps no region"
unregistered, unregister = [], debug.unregister_comm
def counting(comm):
    unregistered.append(comm)
    unregister(comm)
debug.unregister_comm = counting
sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
start, errors = threading.Barrier(2), []
def closer():
    start.wait()
    for _ in range(500):
        try:
            c.close()
        except BaseException as e:  # noqa: BLE001 - every exception is the failure
            errors.append(repr(e))
ts = [threading.Thread(target=closer, name=f"closer{i}") for i in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
assert not errors, errors[:3]
assert c.closed and c.buffer_ranges() == [], c.buffer_ranges()
assert unregistered == [c], f"the close's work ran {len(unregistered)} times"
c.close()
assert len(unregistered) == 1
assert resources() == before, f"regions, threads, descriptors: {before} -> {resources()}"
print("OK")
""")
    assert_clean(rc, out, err)
    assert "OK" in out


def test_an_operation_beside_another_threads_hold_is_still_refused():
    """What close() leaves as it was: a thread arriving while another holds
    the communicator for its operations is refused (ranks pair operations in
    the order each rank issues them), and the communicator refuses work from
    then on, the holder's included; close() still works, and again is a no-op."""
    c = comm()
    errors = []

    def operate():
        try:
            c.synchronize()
        except RuntimeError as e:
            errors.append(str(e))

    with pytest.raises(RuntimeError, match="thread 'second' called it while thread"):
        with c.exclusive():  # the holder's own operations end refused too
            t = threading.Thread(target=operate, name="second")
            t.start()
            t.join()
    assert len(errors) == 1 and "thread 'second' called it while thread" in errors[0], errors
    with pytest.raises(RuntimeError, match="called it while thread"):
        c.get_buffer()
    c.close()
    c.close()
    assert c.closed
