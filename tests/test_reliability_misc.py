"""Smaller misuses of the communicators: each is a clear error, never a silently
wrong view or a dangling mapping. Snippets that could crash run in a
subprocess."""
import math

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
