"""The engine's FP8 operations (_fp8_engine.py over csrc/core/fp8.c and its
CPU / CUDA kernels): the quantize op bit-exact against torch's float8 casts
of the saturated, scaled value; amax; current scaling's scales against a
hand-computed float32 reference; the FP8 GEMM against a float64 product of
the dequantized operands. Runs on the CPU here, on CUDA where present
(scripts/gpu_fp8.sh)."""
import math
import struct

import pytest
import torch

from transformer_engine_c import _fp8_engine as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8S = [E4M3, E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def torch_quantize(x, fp8_dtype, scale):
    """The reference: x * scale in float32, saturated to the format's range
    (NaN kept), cast by torch (round to nearest even)."""
    m = F.FP8_MAX[fp8_dtype]
    return (x.float() * scale).clamp(-m, m).to(fp8_dtype).view(torch.uint8)


def hard_values(n, dtype, gen):
    """Values across the whole FP8 range: many exact ties between FP8
    neighbours (mantissas k/64), subnormals, saturating magnitudes, zeros of
    both signs, infinities and NaN."""
    e = torch.randint(-20, 20, (n,), generator=gen).float()
    k = torch.randint(0, 64, (n,), generator=gen).float()
    s = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x = s * torch.exp2(e) * (1 + k / 64)
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 2.0 ** -30])
    return x.to(dtype)


def assert_same_fp8(got, want, fp8_dtype=E4M3):
    """Equal bytes where the value is not NaN, NaN at the same places (any
    of the format's NaN codes)."""
    assert got.shape == want.shape
    gnan = got.view(fp8_dtype).float().isnan()
    wnan = want.view(fp8_dtype).float().isnan()
    assert torch.equal(gnan, wnan), "NaN positions differ"
    diff = (got != want) & ~wnan
    assert not diff.any(), f"{int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}: " \
                           f"{int(got[diff][0])} vs {int(want[diff][0])}"


def assert_fp8_differs(got, want):
    with pytest.raises(AssertionError):
        assert_same_fp8(got, want)


@pytest.mark.parametrize("fp8_dtype", FP8S)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.3711, 1024.0, 2.0 ** -12])
def test_quantize_bit_exact(device, fp8_dtype, dtype, scale):
    gen = torch.Generator().manual_seed(7)
    x = hard_values(96 * 72, dtype, gen).reshape(96, 72)
    want = torch_quantize(x, fp8_dtype, scale)
    x = x.to(device)
    sc = torch.tensor([scale], device=device)
    data, data_t, scale_inv = F.quantize(x, fp8_dtype, sc, columnwise=True)
    assert_same_fp8(data.cpu(), want, fp8_dtype)
    assert_same_fp8(data_t.cpu(), want.t().contiguous(), fp8_dtype)
    assert scale_inv.item() == struct.unpack("f", struct.pack("f", 1.0 / struct.unpack("f", struct.pack("f", scale))[0]))[0]


def test_quantize_checker_catches_a_wrong_byte():
    x = torch.randn(64, 32)
    want = torch_quantize(x, E4M3, 1.0)
    got = want.clone()
    got[3, 5] ^= 1
    assert_fp8_differs(got, want)
    got = want.clone()
    got[0, 0] = 0x7F  # a NaN where there was none
    assert_fp8_differs(got, want)


# (264, 520) and (136, 2056): the vector cast+transpose (rows and cols
# multiples of 8) over several tiles with partial ones at both edges
SHAPES = [(1, 1), (3, 5), (127, 129), (8, 1000), (1000, 8), (2, 3, 48), (264, 520), (136, 2056)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("columnwise", [False, True])
def test_quantize_shapes_and_fused_amax(device, shape, columnwise):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 50).to(torch.bfloat16)
    want = torch_quantize(x, E5M2, 0.5)
    amax = torch.tensor([1.0], device=device)  # smaller than max|x|: replaced
    data, data_t, _ = F.quantize(x.to(device), E5M2, torch.tensor([0.5], device=device), amax=amax,
                                 columnwise=columnwise)
    assert_same_fp8(data.cpu(), want, E5M2)
    if columnwise:
        assert_same_fp8(data_t.cpu(), want.reshape(-1, shape[-1]).t().contiguous(), E5M2)
    assert amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("shape", SHAPES + [(300, 16)])
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fused_bias_gradient(device, shape, columnwise, dtype):
    """dbias: x's column sums from the cast's own pass (float32 sums), the
    codes unchanged by it, and the same sums on every run (a fixed order)."""
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    cols = shape[-1]
    want = x.double().reshape(-1, cols).sum(0)
    sc = torch.tensor([2.0], device=device)
    xd = x.to(device)
    dbs = []
    for _ in range(2):
        db = torch.full((cols,), float("nan"), dtype=dtype, device=device)
        data, data_t, _ = F.quantize(xd, E5M2, sc, columnwise=columnwise, dbias=db)
        dbs.append(db.cpu())
    assert_same_fp8(data.cpu(), torch_quantize(x, E5M2, 2.0), E5M2)
    rows = x.numel() // cols
    tol = dict(rtol=0, atol=(2e-5 * rows ** 0.5 + 1e-6) * 3) if dtype is torch.float32 else \
        dict(rtol=1e-2, atol=1e-2 * 3 * rows ** 0.5)
    torch.testing.assert_close(dbs[0].double(), want, **tol)
    assert torch.equal(dbs[0], dbs[1])
    bad = dbs[0].double().clone()
    bad[cols // 2] += 1.0 + abs(float(want[cols // 2]))  # the check catches one wrong sum
    with pytest.raises(AssertionError):
        torch.testing.assert_close(bad, want, **tol)


def test_quantize_dbias_bad_input():
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"dbias must be a contiguous torch.float32 tensor of shape \(16,\)"):
        F.quantize(x, E4M3, torch.ones(1), dbias=torch.empty(8))
    with pytest.raises(ValueError, match="dbias must be"):
        F.quantize(x, E4M3, torch.ones(1), dbias=torch.empty(16, dtype=torch.bfloat16))


def _quantize_into_sentinels(x, device, noop, columnwise, with_dbias):
    """quantize into outputs prefilled with sentinels (0xA5 bytes, amax 7,
    scale_inv 3, dbias 11) under the noop flag `noop`; returns the outputs."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    out = torch.full(x.shape, 0xA5, dtype=torch.uint8, device=device)
    out_t = torch.full((cols, rows), 0xA5, dtype=torch.uint8, device=device) if columnwise else None
    amax = torch.tensor([7.0], device=device)
    sinv = torch.tensor([3.0], device=device)
    db = torch.full((cols,), 11.0, dtype=x.dtype, device=device) if with_dbias else None
    F.quantize(x.to(device), E4M3, torch.tensor([0.5], device=device), amax=amax, columnwise=columnwise, out=out,
               out_t=out_t, scale_inv=sinv, dbias=db, noop=noop)
    return out, out_t, amax, sinv, db


def assert_untouched(outs):
    out, out_t, amax, sinv, db = (None if t is None else t.cpu() for t in outs)
    assert bool((out == 0xA5).all()), "the rowwise output was written"
    assert out_t is None or bool((out_t == 0xA5).all()), "the transpose was written"
    assert amax.item() == 7.0 and sinv.item() == 3.0, "amax or scale_inv was written"
    assert db is None or bool((db == 11.0).all()), "dbias was written"


# the vector cast+transpose, the scalar tile kernel, the rowwise kernel (with and without dbias)
NOOP_CASES = [((264, 520), True, False), ((264, 520), True, True), ((127, 129), True, True),
              ((127, 129), False, True), ((96, 64), False, False)]


@pytest.mark.parametrize("shape,columnwise,with_dbias", NOOP_CASES)
@pytest.mark.parametrize("flag", [1.0, -2.0, float("nan")])
def test_quantize_noop_flag_writes_nothing(device, shape, columnwise, with_dbias, flag):
    """A nonzero noop flag (read by the device) switches every kernel of the
    cast off: outputs, amax, scale_inv and dbias keep what they held."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 9).to(torch.bfloat16)
    outs = _quantize_into_sentinels(x, device, torch.tensor([flag], device=device), columnwise, with_dbias)
    assert_untouched(outs)


@pytest.mark.parametrize("shape,columnwise,with_dbias", NOOP_CASES)
def test_quantize_noop_flag_zero_casts_as_without_it(device, shape, columnwise, with_dbias):
    """Flag 0: the same outputs as a cast without a flag; and the
    untouched-check sees those writes (it is not vacuous)."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 9).to(torch.bfloat16)
    got = _quantize_into_sentinels(x, device, torch.zeros(1, device=device), columnwise, with_dbias)
    want = _quantize_into_sentinels(x, device, None, columnwise, with_dbias)
    for g, w in zip(got, want):
        assert (g is None) == (w is None) and (g is None or torch.equal(g.cpu(), w.cpu()))
    assert_same_fp8(got[0].cpu(), torch_quantize(x, E4M3, 0.5))
    with pytest.raises(AssertionError, match="written"):
        assert_untouched(got)


def test_quantize_noop_flag_is_read_when_the_cast_runs(device):
    """The flag's value at run time decides, not at the call's set-up: one
    flag tensor, flipped between two casts into the same outputs."""
    flag = torch.ones(1, device=device)
    x1 = torch.randn(64, 32, device=device)
    out = torch.full((64, 32), 0xA5, dtype=torch.uint8, device=device)
    F.quantize(x1, E4M3, torch.ones(1, device=device), out=out, noop=flag)
    assert bool((out == 0xA5).all())
    flag.zero_()
    F.quantize(x1, E4M3, torch.ones(1, device=device), out=out, noop=flag)
    assert_same_fp8(out.cpu(), torch_quantize(x1.cpu(), E4M3, 1.0))


def test_quantize_noop_bad_input(device):
    x = torch.randn(8, 16, device=device)
    with pytest.raises(TypeError, match="noop must be a float32 tensor of one element"):
        F.quantize(x, E4M3, torch.ones(1, device=device), noop=torch.zeros(1, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="noop must be a float32 tensor of one element"):
        F.quantize(x, E4M3, torch.ones(1, device=device), noop=torch.zeros(2, device=device))
    with pytest.raises(TypeError, match="noop must be"):
        F.quantize(x, E4M3, torch.ones(1, device=device), noop=True)
    if device == "cpu" and torch.cuda.is_available():
        with pytest.raises(ValueError, match="noop is on cuda"):
            F.quantize(x, E4M3, torch.ones(1), noop=torch.zeros(1, device="cuda"))


def test_fused_amax_keeps_a_larger_value_and_ignores_nan(device):
    x = torch.tensor([[1.0, -3.0, float("nan"), 2.0]], device=device)
    amax = torch.tensor([5.0], device=device)
    F.quantize(x, E4M3, torch.ones(1, device=device), amax=amax)
    assert amax.item() == 5.0  # the max of what it held and max |x|
    amax.zero_()
    F.quantize(x, E4M3, torch.ones(1, device=device), amax=amax, rowwise=False)
    assert amax.item() == 3.0  # NaN ignored (fmaxf), as TE's kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_amax(device, dtype):
    x = (torch.randn(1001, generator=torch.Generator().manual_seed(1)) * 9).to(dtype)
    x[417] = -70.0
    assert F.amax(x.to(device)).item() == 70.0
    assert F.amax(torch.empty(0, dtype=dtype, device=device)).item() == 0.0


def f32(v):
    return struct.unpack("f", struct.pack("f", v))[0]


def ref_scale(amax, fp8_max, pow2, eps):
    """Current scaling's rule, written out in float32 steps."""
    a = max(amax, eps) if not math.isnan(amax) else amax
    if math.isinf(a) or a == 0.0 or math.isnan(a):
        return 1.0
    s = f32(fp8_max / a) if fp8_max / a <= 3.4028234663852886e38 else math.inf
    if math.isinf(s):
        s = 3.4028234663852886e38
    if pow2:
        s = 2.0 ** math.floor(math.log2(s))
    return s


@pytest.mark.parametrize("fp8_dtype", FP8S)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-2])
def test_scale_from_amax(device, fp8_dtype, pow2, eps):
    vals = [0.0, float("inf"), float("nan"), 1e-44, 3.0, 448.0, 1e-3, 57344.0, 7.25]
    amax = torch.tensor(vals, device=device)
    scale, scale_inv = F.scale_from_amax(amax, fp8_dtype, power_2_scale=pow2, amax_epsilon=eps)
    want = [ref_scale(f32(v), F.FP8_MAX[fp8_dtype], pow2, eps) for v in vals]
    assert scale.cpu().tolist() == want
    assert scale_inv.cpu().tolist() == [f32(1.0 / w) for w in want]


def test_scale_reference_is_not_vacuous():
    assert ref_scale(3.0, 448.0, False, 0.0) != ref_scale(3.0, 448.0, True, 0.0)
    assert ref_scale(0.0, 448.0, False, 0.0) == 1.0 and ref_scale(1e-3, 448.0, False, 1e-2) == f32(448.0 / 1e-2)


# ------------------------------------------------------------------ GEMM


def quantized(shape, fp8_dtype, gen, device, spread=4.0):
    x = torch.randn(shape, generator=gen) * spread
    s = torch.tensor([F.FP8_MAX[fp8_dtype] / (x.abs().max().item() * 1.5)])
    data = torch_quantize(x, fp8_dtype, s)
    return data.to(device), (1.0 / s).to(device)


def deq64(data, scale_inv, fp8_dtype):
    return data.cpu().view(fp8_dtype).double() * scale_inv.cpu().double()


def rel_err(got, want):
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def test_rel_err_catches_a_wrong_product():
    gen = torch.Generator().manual_seed(3)
    a, sa = quantized((32, 64), E4M3, gen, "cpu")
    b, sb = quantized((48, 64), E4M3, gen, "cpu")
    want = deq64(a, sa, E4M3) @ deq64(b, sb, E4M3).t()
    wrong = F.fp8_gemm(a, sa * 1.01, E4M3, b, sb, E4M3, out_dtype=torch.float32)
    assert rel_err(wrong, want) > 5e-3


def fp32_tol(device):
    """Relative error allowed for an FP8 GEMM accumulated and written in fp32:
    the CPU's emulation sums exactly-represented products in fp32; Hopper's
    FP8 tensor cores keep fewer bits inside each accumulation chunk even with
    split accumulation (about 1e-4 relative measured on an H200, the same as
    torch._scaled_mm)."""
    return 1e-5 if device == "cpu" else 3e-4


@pytest.mark.parametrize("formats", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("fast", [False, True])
def test_fp8_gemm_against_float64(device, formats, out_dtype, fast):
    fa, fb = formats
    gen = torch.Generator().manual_seed(11)
    m, n, k = 64, 48, 160
    a, sa = quantized((m, k), fa, gen, device)
    b, sb = quantized((n, k), fb, gen, device)
    want = deq64(a, sa, fa) @ deq64(b, sb, fb).t()
    got = F.fp8_gemm(a, sa, fa, b, sb, fb, out_dtype=out_dtype, use_split_accumulator=not fast)
    assert got.dtype == out_dtype and got.shape == (m, n)
    tol = {torch.float32: fp32_tol(device), torch.bfloat16: 6e-3, torch.float16: 1e-3}[out_dtype]
    if fast and device != "cpu":
        tol = max(tol, 2e-3)  # Hopper's fast FP8 accumulation keeps fewer bits
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fp8_gemm_bias_and_accumulate(device, out_dtype):
    gen = torch.Generator().manual_seed(5)
    a, sa = quantized((32, 64), E4M3, gen, device)
    b, sb = quantized((16, 64), E4M3, gen, device)
    prod = deq64(a, sa, E4M3) @ deq64(b, sb, E4M3).t()
    bias_dtype = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
    bias = torch.randn(16, generator=gen).to(bias_dtype)
    got = F.fp8_gemm(a, sa, E4M3, b, sb, E4M3, out_dtype=out_dtype, bias=bias.to(device))
    tol = fp32_tol(device) if out_dtype == torch.float32 else 6e-3
    assert rel_err(got, prod + bias.double()) < tol
    main_grad = torch.randn(32, 16, generator=gen)
    acc = main_grad.clone().to(device)
    F.fp8_gemm(a, sa, E4M3, b, sb, E4M3, out=acc, accumulate=True)
    assert rel_err(acc, main_grad.double() + prod) < fp32_tol(device)


def test_fp8_gemm_bad_input(device):
    gen = torch.Generator().manual_seed(2)
    a, sa = quantized((32, 64), E5M2, gen, device)
    b, sb = quantized((16, 64), E5M2, gen, device)
    with pytest.raises(ValueError, match="both be E5M2"):
        F.fp8_gemm(a, sa, E5M2, b, sb, E5M2)
    with pytest.raises(ValueError, match="divisible by 8 and its last dim by 16"):
        F.fp8_gemm(a[:, :40].contiguous(), sa, E4M3, b[:, :40].contiguous(), sb, E4M3)
    with pytest.raises(ValueError, match="divisible by 8"):
        F.fp8_gemm(a[:12].contiguous(), sa, E4M3, b, sb, E4M3)
    with pytest.raises(ValueError, match="last dims"):
        F.fp8_gemm(a, sa, E4M3, b[:, :48].contiguous(), sb, E4M3)
    with pytest.raises(TypeError, match="torch.uint8"):
        F.fp8_gemm(a.float(), sa, E4M3, b, sb, E4M3)
    with pytest.raises(TypeError, match="a_scale_inv must be a float32 tensor of one element"):
        F.fp8_gemm(a, torch.ones(2, device=device), E4M3, b, sb, E4M3)
    with pytest.raises(TypeError, match="a_dtype must be torch.float8_e4m3fn"):
        F.fp8_gemm(a, sa, torch.bfloat16, b, sb, E4M3)
    with pytest.raises(TypeError, match="bias has dtype"):
        F.fp8_gemm(a, sa, E4M3, b, sb, E5M2, bias=torch.zeros(16, device=device))


def test_quantize_bad_input(device):
    x = torch.randn(4, 16, device=device)
    one = torch.ones(1, device=device)
    with pytest.raises(TypeError, match="fp8_dtype must be"):
        F.quantize(x, torch.int8, one)
    with pytest.raises(TypeError, match="scale must be a float32 tensor of one element"):
        F.quantize(x, E4M3, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="nothing to produce"):
        F.quantize(x, E4M3, one, rowwise=False)
    with pytest.raises(ValueError, match="at least 2 dims"):
        F.quantize(x[0], E4M3, one, columnwise=True)
    with pytest.raises(TypeError, match="out must be a contiguous torch.uint8"):
        F.quantize(x, E4M3, one, out=torch.empty(4, 16, device=device))
    with pytest.raises(ValueError, match="amax_epsilon"):
        F.scale_from_amax(one, E4M3, amax_epsilon=-1.0)


def test_engine_checks_reach_python():
    """The C checks behind the wrappers name what is wrong (ValueError)."""
    from transformer_engine_c import _C
    one = torch.ones(1)
    with pytest.raises(ValueError, match="missing scale"):
        _C.fp8_quantize(-1, 0, 0, 1, 1, torch.ones(1).data_ptr(), 0, torch.empty(1, dtype=torch.uint8).data_ptr(),
                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="format"):
        _C.fp8_quantize(-1, 0, 2, 1, 1, one.data_ptr(), one.data_ptr(), 0, 0, one.data_ptr(), 0, 0, 0, 0, 0, 0, 0, 0,
                        0)
    with pytest.raises(ValueError, match="dbias needs a workspace of 4 bytes, got 0"):
        _C.fp8_quantize(-1, 0, 0, 1, 1, one.data_ptr(), one.data_ptr(), 0, 0, 0, 0, one.data_ptr(), 0, 0, 0, 0, 0, 0,
                        0)
    amax = torch.zeros(1)
    with pytest.raises(ValueError, match="act_mode"):
        _C.fp8_quantize(-1, 0, 0, 1, 1, one.data_ptr(), one.data_ptr(), 0, 0, amax.data_ptr(), 0, 0, 0, 0, 0, 3, 0,
                        0, 0)
    with pytest.raises(ValueError, match="element-wise ones .* got 20"):
        _C.fp8_quantize(-1, 0, 0, 1, 1, one.data_ptr(), one.data_ptr(), 0, 0, amax.data_ptr(), 0, 0, 0, 0, 0, 1, 20,
                        0, 0)
    with pytest.raises(ValueError, match="backward needs act_input"):
        _C.fp8_quantize(-1, 0, 0, 1, 1, one.data_ptr(), one.data_ptr(), 0, 0, amax.data_ptr(), 0, 0, 0, 0, 0, 2, 0,
                        0, 0)
    with pytest.raises(ValueError, match="fp8_max must be finite"):
        _C.fp8_scale_from_amax(-1, 1, one.data_ptr(), one.data_ptr(), 0, 0.0, 0, 0.0, 0)
    with pytest.raises(ValueError, match="leading dimension too small"):
        _C.fp8_gemm(-1, 16, 16, 16, 0, 0, one.data_ptr(), 8, one.data_ptr(), 16, one.data_ptr(), one.data_ptr(),
                    one.data_ptr(), 16, 0, 0, 0, 0, 0, 0, 0)


def test_the_three_linear_gemms_through_the_tn_layout(device):
    """fprop Y = X W^T, dgrad dX = dY W (W's transpose as B), wgrad
    dW = dY^T X (both transposes) from one cast+transpose per tensor,
    HYBRID formats, against float64 products of the dequantized tensors."""
    gen = torch.Generator().manual_seed(9)
    t, i, o = 64, 96, 48
    x, w, dy = torch.randn(t, i, generator=gen), torch.randn(o, i, generator=gen), torch.randn(t, o, generator=gen)

    def cast(v, fp8_dtype):
        s = torch.tensor([F.FP8_MAX[fp8_dtype] / v.abs().max().item()], device=device)
        d, d_t, si = F.quantize(v.to(device).to(torch.bfloat16), fp8_dtype, s, columnwise=True)
        return d, d_t, si, deq64(d, si, fp8_dtype)

    xd, xt, xs, x64 = cast(x, E4M3)
    wd, wt, ws, w64 = cast(w, E4M3)
    gd, gt, gs, g64 = cast(dy, E5M2)
    y = F.fp8_gemm(xd, xs, E4M3, wd, ws, E4M3, out_dtype=torch.float32, use_split_accumulator=False)
    dx = F.fp8_gemm(gd, gs, E5M2, wt, ws, E4M3, out_dtype=torch.float32)
    dw = F.fp8_gemm(gt, gs, E5M2, xt, xs, E4M3, out_dtype=torch.float32)
    tol = 1e-5 if device == "cpu" else 2e-3
    assert rel_err(y, x64 @ w64.t()) < tol
    assert rel_err(dx, g64 @ w64) < tol
    assert rel_err(dw, g64.t() @ x64) < tol


def test_fp8_gemm_with_k_zero(device):
    a = torch.empty(16, 0, dtype=torch.uint8, device=device)
    b = torch.empty(32, 0, dtype=torch.uint8, device=device)
    one = torch.ones(1, device=device)
    bias = torch.arange(32, dtype=torch.bfloat16, device=device)
    out = F.fp8_gemm(a, one, E4M3, b, one, E4M3, out_dtype=torch.float32, bias=bias)
    assert torch.equal(out.cpu(), bias.float().cpu().expand(16, 32))
    acc = torch.full((16, 32), 2.0, device=device)
    F.fp8_gemm(a, one, E4M3, b, one, E4M3, out=acc, accumulate=True)
    assert torch.equal(acc.cpu(), torch.full((16, 32), 2.0))


def _history_cases(gen, length, n):
    h = torch.rand(length, n, generator=gen) * torch.exp2(torch.randint(-20, 20, (length, n), generator=gen).float())
    h[:, 0] = 0.0                                 # amax 0: the old scale stays
    if length > 1:
        h[1, 1] = float("nan")                    # NaN entries are skipped by "max"
        h[0, 2] = float("inf")                    # inf: the old scale stays
    h[0, 3] = float("nan")                        # most_recent NaN: the old scale stays
    h[:, 4] = 1e-44                               # fp8_max / amax overflows: FLT_MAX
    return h


@pytest.mark.parametrize("length", [1, 2, 31, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 0.5])
def test_delayed_update_equals_the_rule(device, length, algo, margin):
    """The engine's one-call update is bit-identical to _fp8_meta's rule in
    torch operations (which a callable amax_compute_algo still takes)."""
    from transformer_engine_c import _fp8_meta
    from transformer_engine_c.recipe import DelayedScaling

    gen = torch.Generator().manual_seed(length)
    n = 6
    h = _history_cases(gen, length, n).to(device)
    scale = (torch.rand(n, generator=gen) + 0.5).to(device)
    fast = _fp8_meta.FP8TensorMeta.of(scale.clone(), torch.zeros(n, device=device), h.clone())
    slow = _fp8_meta.FP8TensorMeta.of(scale.clone(), torch.zeros(n, device=device), h.clone())
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    _fp8_meta.amax_and_scale_update(fast, 448.0, recipe)
    torch_rule = (lambda t: t[0]) if algo == "most_recent" else \
        (lambda t: torch.where(t.isnan(), torch.zeros_like(t), t).max(dim=0).values)
    _fp8_meta.amax_and_scale_update(slow, 448.0, DelayedScaling(amax_history_len=length, amax_compute_algo=torch_rule,
                                                                margin=margin))
    for a, b in ((fast.scale, slow.scale), (fast.scale_inv, slow.scale_inv), (fast.amax_history, slow.amax_history)):
        assert torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))
    assert not torch.equal(fast.scale.cpu(), scale.cpu())  # something was updated


def test_delayed_update_checker_sees_a_wrong_scale():
    from transformer_engine_c import _fp8_meta
    from transformer_engine_c.recipe import DelayedScaling

    h = torch.rand(4, 3) + 0.1
    a = _fp8_meta.FP8TensorMeta.of(torch.ones(3), torch.ones(3), h.clone())
    b = _fp8_meta.FP8TensorMeta.of(torch.ones(3), torch.ones(3), h.clone())
    _fp8_meta.amax_and_scale_update(a, 448.0, DelayedScaling(amax_history_len=4))
    _fp8_meta.amax_and_scale_update(b, 448.0, DelayedScaling(amax_history_len=4, margin=1))
    assert not torch.equal(a.scale, b.scale)


def test_delayed_update_bad_input():
    with pytest.raises(ValueError, match="history length"):
        F.delayed_update(torch.zeros(F.HISTORY_MAX + 1, 2), torch.ones(2), torch.ones(2), 448.0)
    with pytest.raises(ValueError, match="scale must be"):
        F.delayed_update(torch.zeros(4, 2), torch.ones(3), torch.ones(2), 448.0)


def test_delayed_updates_in_one_call_equal_one_by_one(device):
    """delayed_updates_call runs several sets (other lengths, widths,
    fp8_max, divisors, most_recent) in one engine call per device: the same
    bits as one delayed_update each, in order."""
    gen = torch.Generator().manual_seed(3)
    sets = [(4, 6, 448.0, 1.0, False), (1, 3, 57344.0, 2.0, False), (16, 9, 448.0, 0.5, True)]
    one, many = [], []
    for length, n, fp8_max, divisor, recent in sets:
        h = _history_cases(gen, length, n) if n >= 5 else torch.rand(length, n, generator=gen) + 0.1
        s0 = torch.rand(n, generator=gen) + 0.5
        for out in (one, many):
            out.append((h.clone().to(device), s0.clone().to(device), torch.zeros(n, device=device), fp8_max, divisor,
                        recent))
    for t in one:
        F.delayed_update(*t[:4], divisor=t[4], most_recent=t[5])
    run = F.delayed_updates_call(many)
    run()
    for a, b in zip(one, many):
        for x, y in zip(a[:3], b[:3]):
            assert torch.equal(x.cpu().view(torch.int32), y.cpu().view(torch.int32))
    assert not torch.equal(many[0][1].cpu(), one[0][1].cpu() * 0)  # a real update ran
    from transformer_engine_c import _C
    from transformer_engine_c._engine import device_code, stream_of

    # the single-set entry point gives the same bits
    length, n, fp8_max, divisor, recent = sets[2]
    h, s0 = _history_cases(torch.Generator().manual_seed(5), length, n).to(device), torch.ones(n, device=device)
    ref = [h.clone(), s0.clone(), torch.zeros(n, device=device)]
    got = [h.clone(), s0.clone(), torch.zeros(n, device=device)]
    F.delayed_updates_call([(*ref, fp8_max, divisor, recent)])()
    dev = torch.device(device)
    _C.fp8_delayed_update(device_code(dev), got[0].data_ptr(), got[1].data_ptr(), got[2].data_ptr(), length, n,
                          fp8_max, divisor, int(recent), stream_of(dev))
    for x, y in zip(ref, got):
        assert torch.equal(x.cpu().view(torch.int32), y.cpu().view(torch.int32))

    with pytest.raises(ValueError, match="whole number of 64-byte records"):
        _C.fp8_delayed_updates(-1, bytes(8 * 3), 0)
    bad = torch.tensor([0, 0, 0, 0, 1, 0, 0, 0], dtype=torch.int64)  # history length 0
    with pytest.raises(ValueError, match="history length"):
        _C.fp8_delayed_updates(-1, F._pack_records([bad.tolist()]), 0)
    # an address is refused: the table is read where it lies, so it must be host bytes
    with pytest.raises(TypeError, match="records must be bytes"):
        _C.fp8_delayed_updates(-1, bad.data_ptr(), 0)
    with pytest.raises(TypeError, match="records must be bytes"):
        _C.fp8_delayed_updates(-1, bad, 0)


def test_delayed_updates_under_another_default_device(device):
    """The records table is host memory whatever the default device: with
    torch.set_default_device naming another device (CUDA in a training
    script; "meta" here, which has no memory at all), the prepared updates
    still run and give the bits of the one-by-one update."""
    gen = torch.Generator().manual_seed(11)
    h = _history_cases(gen, 4, 6).to(device)
    one = [h.clone(), torch.ones(6, device=device), torch.zeros(6, device=device)]
    many = [h.clone(), torch.ones(6, device=device), torch.zeros(6, device=device)]
    F.delayed_update(*one, 448.0)
    with torch.device("meta"):
        run = F.delayed_updates_call([(*many, 448.0, 1.0, False)])
        run()
    for x, y in zip(one, many):
        assert torch.equal(x.cpu().view(torch.int32), y.cpu().view(torch.int32))
    assert not torch.equal(many[1].cpu(), torch.ones(6))  # the update ran


# ------------------------------------------------- activation fused with the cast

ELEMENTWISE = ["gelu", "relu", "qgelu", "srelu", "silu"]


@pytest.mark.parametrize("activation", ELEMENTWISE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("shape", [(256, 512), (136, 264), (37, 70)])
def test_quantize_fused_activation_is_act_then_cast(device, activation, dtype, backward, shape):
    """quantize(activation=...) gives the bytes, transpose, amax and
    scale_inv of the activation (or its backward) into a tensor followed by
    the plain cast, bit for bit, on the vector, tiled and rowwise kernels
    (shapes: multiples of 8, not, odd); its bias gradient is the float64
    column sum of the unrounded values."""
    from transformer_engine_c import _engine
    gen = torch.Generator().manual_seed(11)
    h = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    g = torch.randn(shape, generator=gen).to(dtype).to(device)
    fp8 = E5M2 if backward else E4M3
    scale = torch.tensor([0.75], device=device)
    x, act_input = (g, h) if backward else (h, None)
    want_v = _engine.act_bwd(g, h, activation) if backward else _engine.act_fwd(h, activation)
    amax_w, amax_g = torch.zeros(1, device=device), torch.zeros(1, device=device)
    dbias = torch.empty(shape[1], dtype=dtype, device=device)
    for columnwise in (False, True):
        want = F.quantize(want_v, fp8, scale, amax=amax_w, columnwise=columnwise)
        got = F.quantize(x, fp8, scale, amax=amax_g, columnwise=columnwise, activation=activation,
                         activation_input=act_input, dbias=dbias if columnwise else None)
        assert_same_fp8(got[0], want[0], fp8)
        if columnwise:
            assert_same_fp8(got[1], want[1], fp8)
        assert torch.equal(got[2], want[2])
        assert torch.equal(amax_g, amax_w), (amax_g, amax_w)
    # amax alone (current scaling's first pass)
    amax_only = torch.zeros(1, device=device)
    F.quantize(x, fp8, scale, amax=amax_only, rowwise=False, activation=activation, activation_input=act_input)
    assert torch.equal(amax_only, amax_w)
    # the bias gradient: float32 sums of the unrounded values against float64
    hd = h.double().cpu()
    ref = torch.nn.functional.gelu(hd, approximate="tanh") if activation == "gelu" else None
    if backward:
        exact = _act_grad64(activation, hd) * g.double().cpu()
    else:
        exact = ref if ref is not None else _act64(activation, hd)
    want_db = exact.sum(0)
    tol = 1e-2 if dtype is not torch.float32 else 1e-4
    assert torch.allclose(dbias.double().cpu(), want_db, rtol=tol, atol=tol * shape[0] ** 0.5), \
        (dbias.double().cpu() - want_db).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 512), (136, 264), (264, 520), (72, 64)])
def test_fused_backward_bias_gradient_sums_in_the_plain_casts_order(device, dtype, shape):
    """relu's backward is exact (g or 0), so the fused backward cast's bias
    gradient must equal, bit for bit, the plain cast's over relu's backward
    written out: both sum every 64-row partial (a tile of the vector kernel
    with dbias) in the same order, whichever kernel variant runs."""
    from transformer_engine_c import _engine
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(shape, generator=gen).to(dtype).to(device)
    g = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    scale = torch.tensor([0.5], device=device)
    fused, plain = (torch.empty(shape[1], dtype=dtype, device=device) for _ in range(2))
    F.quantize(g, E5M2, scale, columnwise=True, activation="relu", activation_input=h, dbias=fused)
    F.quantize(_engine.act_bwd(g, h, "relu"), E5M2, scale, columnwise=True, dbias=plain)
    assert torch.equal(fused, plain), (fused.double() - plain.double()).abs().max()
    want = (g.double() * (h.double() > 0)).sum(0)
    torch.testing.assert_close(fused.double(), want, rtol=1e-2, atol=1e-2 * shape[0] ** 0.5)


def _act64(name, x):
    if name == "gelu":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if name == "relu":
        return x.clamp(min=0)
    if name == "qgelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "srelu":
        return x.clamp(min=0) ** 2
    return x * torch.sigmoid(x)


def _act_grad64(name, x):
    x = x.clone().requires_grad_(True)
    _act64(name, x).sum().backward()
    return x.grad


def test_quantize_fused_activation_differs_from_the_plain_cast(device):
    """The negative case: the fused cast is not the cast of x itself (a
    kernel that ignored the activation would pass the equality above only
    if the activation were the identity)."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(64, 64, generator=gen).to(torch.bfloat16).to(device)
    scale = torch.tensor([1.0], device=device)
    plain = F.quantize(h, E4M3, scale, columnwise=True)
    fused = F.quantize(h, E4M3, scale, columnwise=True, activation="gelu")
    assert_fp8_differs(fused[0], plain[0])
    assert_fp8_differs(fused[1], plain[1])


def test_quantize_fused_activation_bad_input():
    x = torch.ones(4, 4)
    s = torch.ones(1)
    with pytest.raises(ValueError, match="element-wise .* gated 'swiglu'"):
        F.quantize(x, E4M3, s, activation="swiglu")
    with pytest.raises(ValueError, match="activation_input is given without an activation"):
        F.quantize(x, E4M3, s, activation_input=x)
    with pytest.raises(ValueError, match="activation_input must match x"):
        F.quantize(x, E4M3, s, activation="gelu", activation_input=torch.ones(4, 5))
    with pytest.raises(ValueError, match="not supported"):
        F.quantize(x, E4M3, s, activation="tanh")
