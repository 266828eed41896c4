"""Block-scaled FP8 (TE's Float8BlockScaling): the engine's block quantize
byte-exact against a plain-PyTorch reference of TE's rule (1x128 and
128x128 block amaxes, the scale rule with power-of-two rounding and
amax_epsilon, saturation, zero blocks, partial blocks at the edges, the
GEMM-ready scale layout); the block-scaled GEMM against dequantize-then-
matmul in float64 (TE's test_float8_blockwise_gemm_exact.py cases); the
quantizer and tensor; the three layers under autocast(recipe=
Float8BlockScaling()) against high precision (test_numerics.py's
tolerances) and against the FP8 values of the recipe; weight caching; and
the errors. On the CPU here, on CUDA where present (scripts/gpu_fp8_block.sh)."""
import math

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c import _C
from transformer_engine_c import _fp8_engine as F
from transformer_engine_c.quantization import FP8GlobalStateManager as G
from transformer_engine_c.recipe import Float8BlockScaling, Format, QParams
from transformer_engine_c.tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
DTYPE_MAX = {torch.float32: torch.finfo(torch.float32).max, torch.bfloat16: torch.finfo(torch.bfloat16).max,
             torch.float16: 65504.0}
B = 128


@pytest.fixture(autouse=True)
def fresh_state():
    G.reset()
    yield
    G.reset()


# ------------------------------------------------------- the reference


def round4(n):
    return (n + 3) // 4 * 4


def ref_scales(x2, fp8_dtype, br, bc, pow2, eps, in_dtype):
    """TE's block scale rule on x2 [rows, cols] (float32) in br x bc blocks:
    (scale per block [nrb, ncb], the scale of every element [rows, cols])."""
    rows, cols = x2.shape
    nrb, ncb = -(-rows // br), -(-cols // bc)
    a = torch.zeros(nrb * br, ncb * bc)
    a[:rows, :cols] = torch.where(x2.isnan(), 0.0, x2.abs())  # NaN takes no part in the amax
    amax = a.reshape(nrb, br, ncb, bc).amax(dim=(1, 3))
    amax = torch.maximum(amax, torch.tensor(float(eps)))
    scale = torch.tensor(MAX[fp8_dtype]) / amax
    scale = torch.where(scale.isinf(), torch.tensor(DTYPE_MAX[in_dtype], dtype=torch.float32), scale)
    scale = torch.where((amax == 0) | amax.isinf(), torch.ones(()), scale)
    if pow2:  # keep sign and exponent
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    return scale, full


def ref_cast(x2, full, fp8_dtype):
    m = MAX[fp8_dtype]
    return (x2 * full).clamp(-m, m).to(fp8_dtype).view(torch.uint8)


def ref_block_quantize(x, fp8_dtype, block_dim, pow2=True, eps=0.0):
    """(data, scale_inv, data_t, scale_inv_t) as tec.h lays them out, the
    scale tensors' padding zero."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    rows, cols = x2.shape
    if block_dim == 2:
        scale, full = ref_scales(x2, fp8_dtype, B, B, pow2, eps, x.dtype)
        data = ref_cast(x2, full, fp8_dtype)
        nrb, ncb = scale.shape
        sinv = torch.zeros(nrb, round4(ncb))
        sinv[:, :ncb] = 1.0 / scale
        sinv_t = torch.zeros(ncb, round4(nrb))
        sinv_t[:, :nrb] = (1.0 / scale).t()
        return data, sinv, data.t().contiguous(), sinv_t
    scale, full = ref_scales(x2, fp8_dtype, 1, B, pow2, eps, x.dtype)  # [rows, ncb]
    data = ref_cast(x2, full, fp8_dtype)
    sinv = torch.zeros(scale.shape[1], round4(rows))
    sinv[:, :rows] = (1.0 / scale).t()
    xt = x2.t().contiguous()  # 128x1 blocks of x: 1x128 blocks of its transpose, their own amaxes
    scale_t, full_t = ref_scales(xt, fp8_dtype, 1, B, pow2, eps, x.dtype)
    data_t = ref_cast(xt, full_t, fp8_dtype)
    sinv_t = torch.zeros(scale_t.shape[1], round4(cols))
    sinv_t[:, :cols] = (1.0 / scale_t).t()
    return data, sinv, data_t, sinv_t


def valid(sinv, rows_or_blocks):
    """The written part of a scale tensor (its padding is not written)."""
    return sinv[:, :rows_or_blocks]


def written(rows, cols, block_dim):
    """How many entries of each row of the rowwise and of the columnwise
    scales of a [rows, cols] cast are written (valid's second argument)."""
    if block_dim == 1:
        return rows, cols
    return -(-cols // B), -(-rows // B)


def ref_dequantize(data, sinv, block_dim, fp8_dtype):
    """data [rows, cols] times its block scales, float64."""
    rows, cols = data.shape
    if block_dim == 2:
        s = sinv[:, :-(-cols // B)].double().repeat_interleave(B, 0).repeat_interleave(B, 1)[:rows, :cols]
    else:
        s = sinv[:, :rows].double().t().repeat_interleave(B, 1)[:, :cols]
    return data.view(fp8_dtype).double() * s


def assert_same_bytes(got, want, fp8_dtype):
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    gnan, wnan = got.view(fp8_dtype).float().isnan(), want.view(fp8_dtype).float().isnan()
    assert torch.equal(gnan, wnan), "NaN positions differ"
    diff = (got != want) & ~wnan
    assert not diff.any(), f"{int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}"


def block_input(rows, cols, dtype, gen):
    """Rows of very different magnitudes (each block its own scale), with a
    zero block, a block of tiny values (fp8_max / amax overflows float32),
    and a block holding inf and NaN."""
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-12, 12, (rows, 1), generator=gen).float())
    x[:min(rows, 2), :min(cols, B)] = 0.0
    if rows > 4:
        x[2, :min(cols, B)] = 1e-38 if dtype != torch.float16 else 1e-7
        x[3, 5], x[3, 6] = float("inf"), float("nan")
    return x.to(dtype)


# ------------------------------------------------------- quantization


SHAPES = [(256, 384), (200, 300), (130, 16), (8, 1000)]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_block_quantize_byte_exact(device, fp8_dtype, dtype, block_dim, shape):
    gen = torch.Generator().manual_seed(sum(shape) + block_dim)
    x = block_input(*shape, dtype, gen)
    got = F.block_quantize(x.to(device), fp8_dtype, block_dim, columnwise=True)
    want = ref_block_quantize(x, fp8_dtype, block_dim)
    rows, cols = shape
    assert_same_bytes(got[0], want[0], fp8_dtype)
    assert_same_bytes(got[2], want[2], fp8_dtype)
    n_row, n_col = written(rows, cols, block_dim)
    assert got[1].shape == want[1].shape and got[3].shape == want[3].shape
    assert torch.equal(valid(got[1].cpu(), n_row), valid(want[1], n_row))
    assert torch.equal(valid(got[3].cpu(), n_col), valid(want[3], n_col))


@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_scales_made_by_the_cast_have_zero_padding(device, block_dim):
    """Scales the cast allocates are zero past the valid blocks, so two casts
    of the same values (a weight and its state-dict copy) are equal byte for
    byte: padding left uninitialized could hold a NaN, which torch.equal
    reports unequal. Memory filled with NaN is freed first, so that padding
    left unwritten would likely show."""
    for _ in range(4):
        torch.full((1024,), float("nan"), device=device)
    x = block_input(130, 64, torch.float32, torch.Generator().manual_seed(3)).to(device)
    _, s, _, st = F.block_quantize(x, E4M3, block_dim, columnwise=True)
    n_row, n_col = written(130, 64, block_dim)
    assert s.shape[1] > n_row or st.shape[1] > n_col  # there is padding to check
    for scales, n in ((s.cpu(), n_row), (st.cpu(), n_col)):
        assert torch.isfinite(valid(scales, n)).all() and (valid(scales, n) > 0).all()
        assert torch.equal(scales[:, n:], torch.zeros_like(scales[:, n:]))


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_scale_rule_pow2_and_epsilon(device, pow2, eps, block_dim):
    gen = torch.Generator().manual_seed(5)
    x = block_input(256, 256, torch.float32, gen) * 1e-3
    d, s, dt, st = F.block_quantize(x.to(device), E4M3, block_dim, columnwise=True, power_2_scale=pow2,
                                    amax_epsilon=eps)
    want = ref_block_quantize(x, E4M3, block_dim, pow2, eps)
    assert_same_bytes(d, want[0], E4M3)
    assert_same_bytes(dt, want[2], E4M3)
    assert torch.equal(s.cpu()[:, :want[1].shape[1]][want[1] != 0], want[1][want[1] != 0])
    sv = s.cpu()[want[1] != 0]
    is_pow2 = torch.equal(sv, torch.exp2(torch.log2(sv).round()))
    assert is_pow2 == pow2 or eps > 0 and not pow2 and is_pow2  # pow2 scales are powers of two


def test_zero_block_has_scale_one_and_epsilon_changes_it(device):
    x = torch.zeros(128, 256, device=device)
    x[:, 128:] = 3.0
    d, s, _, _ = F.block_quantize(x, E4M3, 2)
    assert s[0, 0].item() == 1.0 and int(d[:, :128].max()) == 0
    assert s[0, 1].item() == 2.0 ** -7  # 448 / 3 = 149.3, rounded down to 128
    _, s_eps, _, _ = F.block_quantize(x, E4M3, 2, amax_epsilon=0.5)
    assert s_eps[0, 0].item() == 1.0 / 512  # max(0, eps) = 0.5: 448 / 0.5 = 896 -> 512


def test_columnwise_1x128_has_its_own_blocks(device):
    """128x1 blocks of x are not the transpose of the 1x128 blocks' bytes (the
    reference's negative: a transpose of the rowwise data would differ)."""
    gen = torch.Generator().manual_seed(11)
    x = block_input(256, 256, torch.float32, gen)
    d, _, dt, _ = F.block_quantize(x.to(device), E4M3, 1, columnwise=True)
    assert not torch.equal(dt.cpu(), d.cpu().t().contiguous())
    d2, s2, dt2, st2 = F.block_quantize(x.to(device), E4M3, 2, columnwise=True)
    assert torch.equal(dt2.cpu(), d2.cpu().t().contiguous())
    assert torch.equal(valid(st2.cpu(), 2), valid(s2.cpu(), 2).t())


def test_the_byte_checker_and_reference_are_not_vacuous():
    gen = torch.Generator().manual_seed(3)
    x = block_input(256, 256, torch.float32, gen)
    d, s, _, _ = F.block_quantize(x, E4M3, 1, power_2_scale=True)
    wrong = ref_block_quantize(x, E4M3, 1, pow2=False)
    with pytest.raises(AssertionError):
        assert_same_bytes(d, wrong[0], E4M3)
    wrong2 = ref_block_quantize(x, E4M3, 2)
    with pytest.raises(AssertionError):
        assert_same_bytes(d, wrong2[0], E4M3)
    assert not torch.equal(valid(s, 256), valid(wrong[1], 256))


def test_block_quantize_refuses_bad_input():
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="block_dim must be 1"):
        F.block_quantize(x, E4M3, 3)
    with pytest.raises(ValueError, match="amax_epsilon"):
        F.block_quantize(x, E4M3, 1, amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="columnwise"):
        F.block_quantize(torch.randn(64), E4M3, 1, columnwise=True)
    with pytest.raises(ValueError, match="scale_inv is"):
        F.block_quantize(x, E4M3, 1, scale_inv=torch.empty(2, 64))
    with pytest.raises(TypeError, match="fp8_dtype"):
        F.block_quantize(x, torch.float16, 1)
    # the engine's own checks, past the wrapper
    with pytest.raises(ValueError, match="block_dim"):
        _C.fp8_block_quantize(-1, 0, 0, 3, 64, 64, x.data_ptr(), 0, 0, 0, 0, 1, 0.0, 0)
    with pytest.raises(ValueError, match="without its scale_inv"):
        out = torch.empty(64, 64, dtype=torch.uint8)
        _C.fp8_block_quantize(-1, 0, 0, 1, 64, 64, x.data_ptr(), out.data_ptr(), 0, 0, 0, 1, 0.0, 0)


# ------------------------------------------------------- the GEMM


def gemm_tol(device):
    """The CPU multiplies the dequantized operands in float32; cuBLASLt
    applies the block scales to float32 partial sums of 128."""
    return 1e-5 if device == "cpu" else 5e-4


def rel(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mk_n", [(128, 128, 128), (256, 128, 256), (320, 256, 336), (320, 64, 336),
                                  (1024, 512, 256), (16, 128, 128)])
@pytest.mark.parametrize("dims", [(1, 2), (2, 1), (1, 1)], ids=["1Dx2D", "2Dx1D", "1Dx1D"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_block_gemm_matches_dequantize_then_matmul(device, mk_n, dims, out_dtype):
    m, k, n = mk_n
    gen = torch.Generator().manual_seed(m + k + n)
    a = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=gen).float())
    b = torch.randn(n, k, generator=gen)
    qa, sa, _, _ = F.block_quantize(a.to(device), E4M3, dims[0])
    qb, sb, _, _ = F.block_quantize(b.to(device), E4M3, dims[1])
    got = F.fp8_block_gemm(qa, sa, dims[0], E4M3, qb, sb, dims[1], E4M3, out_dtype=out_dtype)
    want = ref_dequantize(qa.cpu(), sa.cpu(), dims[0], E4M3) @ ref_dequantize(qb.cpu(), sb.cpu(), dims[1], E4M3).t()
    tol = gemm_tol(device) if out_dtype == torch.float32 else 8e-3
    assert rel(got.cpu(), want) < tol
    assert rel(got.cpu(), a.double() @ b.double().t()) > 1e-3  # FP8 rounds: the check is not vacuous


def test_block_gemm_bias_accumulate_and_e5m2(device):
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(256, 256, generator=gen), torch.randn(128, 256, generator=gen)
    qa, sa, _, _ = F.block_quantize(a.to(device), E5M2, 1)
    qb, sb, _, _ = F.block_quantize(b.to(device), E4M3, 2)
    ref = ref_dequantize(qa.cpu(), sa.cpu(), 1, E5M2) @ ref_dequantize(qb.cpu(), sb.cpu(), 2, E4M3).t()
    bias = torch.randn(128, generator=gen).bfloat16()
    y = F.fp8_block_gemm(qa, sa, 1, E5M2, qb, sb, 2, E4M3, out_dtype=torch.float32, bias=bias.to(device))
    assert rel(y.cpu(), ref + bias.double()) < gemm_tol(device)
    acc = torch.ones(256, 128, device=device)
    F.fp8_block_gemm(qa, sa, 1, E5M2, qb, sb, 2, E4M3, out=acc, accumulate=True)
    assert rel(acc.cpu(), ref + 1) < gemm_tol(device)
    wrong = ref_dequantize(qa.cpu(), sa.cpu(), 1, E5M2) @ ref_dequantize(qb.cpu(), sb.cpu() * 2, 2, E4M3).t()
    assert rel(y.cpu(), wrong + bias.double()) > 0.1  # a wrong scale would be seen


def test_block_gemm_refuses_bad_input():
    a = torch.zeros(256, 128, dtype=torch.uint8)
    sa = torch.ones(F.block_scale_shape(a.shape, 1))
    sw = torch.ones(F.block_scale_shape(a.shape, 2))
    with pytest.raises(ValueError, match="cannot both have 128x128"):
        F.fp8_block_gemm(a, sw, 2, E4M3, a, sw, 2, E4M3)
    with pytest.raises(ValueError, match="k .* multiple of 16"):
        a2 = torch.zeros(256, 120, dtype=torch.uint8)
        F.fp8_block_gemm(a2, torch.ones(F.block_scale_shape(a2.shape, 1)), 1, E4M3, a2,
                         torch.ones(F.block_scale_shape(a2.shape, 1)), 1, E4M3)
    with pytest.raises(ValueError, match="n .* multiple of 8"):
        b = torch.zeros(252, 128, dtype=torch.uint8)
        F.fp8_block_gemm(a, sa, 1, E4M3, b, torch.ones(F.block_scale_shape(b.shape, 2)), 2, E4M3)
    with pytest.raises(ValueError, match="b_scale_inv is"):
        F.fp8_block_gemm(a, sa, 1, E4M3, a, sa, 2, E4M3)
    # the engine's own checks
    c = torch.empty(256, 256)
    args = [-1, 256, 256, 128, 0, 0, a.data_ptr(), 128, a.data_ptr(), 128, sw.data_ptr(), sw.data_ptr(),
            c.data_ptr(), 256, 0, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="cannot both have 128x128"):
        _C.fp8_block_gemm(*args, 2, 2)
    with pytest.raises(ValueError, match="cannot be mixed"):
        _C.fp8_block_gemm(*args, 0, 1)
    with pytest.raises(ValueError, match="a_scale_mode"):
        _C.fp8_block_gemm(*args, 3, 1)


# ------------------------------------------------------- quantizer and tensor


def test_quantizer_and_tensor_in_te_style(device):
    x = torch.randn(256, 384, device=device)
    q = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=1)
    t = q(x)
    assert isinstance(t, Float8BlockwiseQTensor) and isinstance(t, te.tensor.QuantizedTensor)
    assert t._rowwise_data.shape == (256, 384) and t._columnwise_data.shape == (384, 256)
    assert t._rowwise_scale_inv.shape == (3, 256) and t._columnwise_scale_inv.shape == (2, 384)
    assert t._fp8_dtype is E4M3 and not t._is_2D_scaled
    assert rel(t.dequantize(), x) < 0.05
    cw_only = q(x)
    cw_only.update_usage(rowwise_usage=False)
    assert cw_only._rowwise_data is None
    assert rel(cw_only.dequantize(), t.dequantize()) < 0.05  # the columnwise copy has other blocks
    w = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False)(x)
    assert w._is_2D_scaled and w._columnwise_data is None
    w.update_usage(columnwise_usage=True)  # a 128x128 transpose comes from the rowwise bytes
    full = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True)(x)
    assert torch.equal(w._columnwise_data, full._columnwise_data)
    assert torch.equal(w._columnwise_scale_inv[:, :2], full._columnwise_scale_inv[:, :2])
    with pytest.raises(RuntimeError, match="cannot be made"):
        Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=1)(x).update_usage(
            columnwise_usage=True)
    assert torch.equal((t + 0).cpu(), t.dequantize().cpu())  # other ops see the values
    saved, obj = t.prepare_for_saving()
    assert t._rowwise_data is None and obj is t
    assert t.restore_from_saved(saved + ["rest"]) == ["rest"]
    assert torch.equal(t.detach()._rowwise_data, t._rowwise_data)
    assert torch.equal(t.clone()._columnwise_data, t._columnwise_data)
    e = q.make_empty((256, 384), device=device)
    e.copy_(x)
    assert torch.equal(e._rowwise_data, t._rowwise_data)
    assert q.is_quantizable(x) and not q.is_quantizable(torch.randn(200, 384))
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=3)


# ------------------------------------------------------- the recipe


def test_recipe_fields_and_checks_are_te_2x():
    r = Float8BlockScaling()
    assert (r.fp8_format, r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == \
        (Format.E4M3, 1, 2, 1)
    assert r.fp8_quant_fwd_inp == QParams(power_2_scale=True, amax_epsilon=0.0)
    assert all(getattr(r, f"fp8_gemm_{g}").use_split_accumulator for g in ("fprop", "dgrad", "wgrad"))
    assert "x_block_scaling_dim=1" in repr(r)
    for kw, match in (({"x_block_scaling_dim": 2}, "x_block_scaling_dim and w_block_scaling_dim"),
                      ({"w_block_scaling_dim": 1, "x_block_scaling_dim": 2, "grad_block_scaling_dim": 2},
                       "x_block_scaling_dim and grad_block_scaling_dim"),
                      ({"w_block_scaling_dim": 3}, "w_block_scaling_dim must be 1"),
                      ({"fp8_gemm_fprop": te.recipe.MMParams(use_split_accumulator=False)}, "fp8_gemm_fprop"),
                      ({"fp8_format": Format.E5M2}, "pure E5M2")):
        with pytest.raises(ValueError, match=match):
            Float8BlockScaling(**kw)


def test_block_scaling_availability_follows_te(monkeypatch):
    from transformer_engine_c import quantization as Q
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    for cc, ok, match in (((9, 0), True, ""), ((10, 0), False, "MXFP8"), ((8, 9), False, "9.0")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cc=cc: cc)
        got, reason = Q.is_fp8_block_scaling_available(return_reason=True)
        assert got is ok and match in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert Q.is_fp8_block_scaling_available() is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    with pytest.raises(RuntimeError, match="MXFP8"):
        with te.autocast(enabled=True, recipe=Float8BlockScaling()):
            pass


# ------------------------------------------------------- the layers


def block_deq(t, block_dim, columnwise=False):
    """t's FP8 value under block scaling (float64): the rowwise copy, or the
    columnwise copy transposed back."""
    d, s, dt, st = ref_block_quantize(t.detach().cpu(), E4M3, block_dim)
    if columnwise:
        return ref_dequantize(dt, st, block_dim, E4M3).t()
    return ref_dequantize(d, s, block_dim, E4M3)


def fp8_tol(device):
    return 1e-5 if device == "cpu" else 5e-4


def test_linear_steps_match_the_block_reference(device):
    """Fprop reads X's 1x128 and W's 128x128 blocks, dgrad dY's 1x128 and W's
    transpose, wgrad the 128x1 (columnwise) blocks of dY and X (TE's
    linear.py usages)."""
    torch.manual_seed(0)
    lin = te.Linear(256, 192, params_dtype=torch.float32, device=device)
    # features of other magnitudes: a 1x128 block of a row mixes them, a 128x1 block does not
    mx, mdy = (torch.exp2(torch.randint(-8, 8, (1, n)).float()) for n in (256, 192))
    x = (torch.randn(160, 256) * mx).to(device).requires_grad_()
    dy = (torch.randn(160, 192) * mdy).to(device)
    with te.autocast(enabled=True, recipe=Float8BlockScaling()):
        y = lin(x)
    y.backward(dy)
    w = lin.weight.detach()
    want_y = block_deq(x, 1) @ block_deq(w, 2).t() + lin.bias.detach().cpu().double()
    assert rel(y.detach().cpu(), want_y) < fp8_tol(device)
    assert rel(x.grad.cpu(), block_deq(dy, 1) @ block_deq(w, 2)) < fp8_tol(device)
    want_dw = block_deq(dy, 1, columnwise=True).t() @ block_deq(x, 1, columnwise=True)
    norm = mdy.t().double() * mx.double()  # every entry of dW on one scale
    assert rel(lin.weight.grad.cpu() / norm, want_dw / norm) < fp8_tol(device)
    rowwise_dw = block_deq(dy, 1).t() @ block_deq(x, 1)  # the other usage: a different product
    assert rel(lin.weight.grad.cpu() / norm, rowwise_dw / norm) > 10 * fp8_tol(device)


def make(kind, device, **kw):
    torch.manual_seed(1)
    common = dict(params_dtype=torch.float32, device=device, **kw)
    if kind == "Linear":
        return te.Linear(256, 192, **common)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(256, 192, **common)
    if kind == "RMSNormLinear":
        return te.LayerNormLinear(256, 192, normalization="RMSNorm", **common)
    return te.LayerNormMLP(256, 384, activation=kind.split(":")[1], **common)


def run(layer, x, dy, recipe, steps=1, **kw):
    for _ in range(steps):
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x, **kw)
        y.backward(dy)
    return y.detach(), x.grad.clone(), {n: None if p.grad is None else p.grad.clone()
                                        for n, p in layer.named_parameters()}


KINDS = ["Linear", "LayerNormLinear", "RMSNormLinear", "MLP:gelu", "MLP:swiglu"]


@pytest.mark.parametrize("kind", KINDS)
def test_layers_in_block_fp8_are_close_to_high_precision(device, kind):
    """test_numerics.py's FP8 tolerances (rtol 0.125, atol 0.0675) on the
    output and every gradient, and within FP8's error in norm."""
    layer = make(kind, device)
    x = torch.randn(2, 96, 256, device=device, requires_grad=True)
    dy = torch.randn(2, 96, 256 if kind.startswith("MLP") else 192, device=device) * 0.02
    y0, dx0, g0 = run(layer, x, dy, None)
    y1, dx1, g1 = run(layer, x, dy, Float8BlockScaling(), steps=2)
    torch.testing.assert_close(y1, y0, rtol=0.125, atol=0.0675)
    torch.testing.assert_close(dx1, dx0, rtol=0.125, atol=0.0675)
    assert 1e-4 < rel(y1, y0) < 0.1 and rel(dx1, dx0) < 0.1
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0.125, atol=0.0675, msg=name)
        assert rel(g1[name], g0[name]) < 0.1, name


def test_bf16_layer_trains_under_block_scaling(device):
    torch.manual_seed(4)
    layer = te.LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device=device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
    target = torch.randn(128, 256, device=device, dtype=torch.bfloat16) * 0.1
    losses = []
    for _ in range(4):
        opt.zero_grad()
        with te.autocast(enabled=True, recipe=Float8BlockScaling()):
            loss = ((layer(x) - target).float() ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_weight_cached_over_micro_batches_under_block_scaling():
    lin = make("Linear", "cpu")
    x = torch.randn(128, 256)
    recipe = Float8BlockScaling()
    with te.autocast(enabled=True, recipe=recipe):
        y_first = lin(x, is_first_microbatch=True)
    with torch.no_grad():
        lin.weight.mul_(2)
    with te.autocast(enabled=True, recipe=recipe):
        y_cached = lin(x, is_first_microbatch=False)
        y_new = lin(x, is_first_microbatch=None)
        y_recast = lin(x, is_first_microbatch=True)
    assert torch.equal(y_cached, y_first)
    assert not torch.equal(y_new, y_first)
    assert torch.equal(y_recast, y_new)
    with te.autocast(enabled=True, recipe=te.recipe.Float8CurrentScaling()):  # another recipe: cast again
        y_other = lin(x, is_first_microbatch=False)
    assert not torch.equal(y_other, y_recast)


def test_mlp_checkpoint_and_delayed_wgrad_equal_the_plain_layer():
    x = torch.randn(64, 256, requires_grad=True)
    dy = torch.randn(64, 256)
    ra = run(make("MLP:gelu", "cpu"), x, dy, Float8BlockScaling())
    rb = run(make("MLP:gelu", "cpu", checkpoint=True), x, dy, Float8BlockScaling())
    c = make("MLP:gelu", "cpu", delay_wgrad_compute=True)
    rc = run(c, x, dy, Float8BlockScaling())
    c.backward_dw()
    rc = (rc[0], rc[1], {n: p.grad for n, p in c.named_parameters()})
    for other in (rb, rc):
        assert torch.equal(ra[0], other[0]) and torch.equal(ra[1], other[1])
        for name in ra[2]:
            assert torch.equal(ra[2][name], other[2][name]), name


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "MLP:gelu"])
@pytest.mark.parametrize("lead", [(0,), (0, 2)])
def test_no_tokens_under_block_scaling(device, kind, lead):
    """An input without tokens: an empty output and input gradient, zero
    parameter gradients, as without FP8."""
    layer = make(kind, device)
    x = torch.randn(*lead, 256, device=device, requires_grad=True)
    with te.autocast(enabled=True, recipe=Float8BlockScaling()):
        y = layer(x)
    assert y.shape == lead + (256 if kind.startswith("MLP") else 192,)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_block_scaling_shape_errors_name_the_argument():
    lin = make("Linear", "cpu")
    with te.autocast(enabled=True, recipe=Float8BlockScaling()):
        with pytest.raises(ValueError, match="inp.*divisible by 8"):
            lin(torch.randn(12, 256))
    narrow = te.Linear(64, 24, device="cpu")
    with te.autocast(enabled=True, recipe=Float8BlockScaling()):
        with pytest.raises(ValueError, match=r"weight .*\(24, 64\)"):
            narrow(torch.randn(16, 64))
