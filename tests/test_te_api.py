"""TE's lower-level Python API: cpp_extensions.general_gemm against a
float64 reference in its three layouts (bf16 / fp16 / fp32 and Float8Tensor
operands, bias, bias gradient, accumulation, a quantized output), and
FP8GlobalStateManager's stash of delayed-scaling tensors for activation
recompute; each with the errors that name the offending argument."""
import collections

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c import _fp8_meta as M
from transformer_engine_c.cpp_extensions import general_gemm
from transformer_engine_c.quantization import RECOMPUTE_POSITION_KEY, FP8GlobalStateManager as G
from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling

from helpers import TOL, rel_err

E4M3 = te.DType.kFloat8E4M3


def _ref(A, B, layout):
    """op(B) @ op(A) in float64 (TE's column-major naming)."""
    a = A.reshape(-1, A.shape[-1]).double()
    b = B.reshape(-1, B.shape[-1]).double()
    op_a = a.t() if layout[0] == "T" else a
    op_b = b.t() if layout[1] == "T" else b
    return op_b @ op_a


def _operands(layout, dtype, device, rows=(3, 8), n=48, k=32):
    """A and B of a linear layer's GEMM in `layout`: fprop (TN), dgrad (NN),
    wgrad (NT), B with leading dims `rows`."""
    g = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    if layout == "TN":
        return rand(n, k), rand(*rows, k)          # weight [n, k], input
    if layout == "NN":
        return rand(k, n), rand(*rows, k)          # weight [k, n], dY
    return rand(*rows, n), rand(*rows, k)          # input, dY: out [k, n]


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_general_gemm_layouts(device, layout, dtype):
    A, B = _operands(layout, dtype, device)
    out, bias_grad, gelu_input, extra = general_gemm(A, B, layout=layout)
    ref = _ref(A, B, layout)
    assert bias_grad is None and gelu_input is None and extra is None
    assert out.dtype == dtype
    if layout == "NT":
        assert out.shape == ref.shape
    else:  # B's leading dims are kept
        assert out.shape == (*B.shape[:-1], ref.shape[1])
    assert rel_err(out.reshape(ref.shape), ref) < TOL[dtype]


def test_general_gemm_bias_out_and_accumulate(device):
    A, B = _operands("TN", torch.bfloat16, device)
    bias = torch.randn(A.shape[0], device=device).bfloat16()
    out, *_ = general_gemm(A, B, torch.float32, bias=bias)
    assert out.dtype == torch.float32
    assert rel_err(out.reshape(-1, A.shape[0]), _ref(A, B, "TN") + bias.double()) < TOL[torch.bfloat16]

    # wgrad into an fp32 main_grad, twice
    X, dY = _operands("NT", torch.bfloat16, device)
    main = torch.randn(dY.shape[-1], X.shape[-1], device=device)
    start = main.clone()
    res, *_ = general_gemm(X, dY, torch.float32, layout="NT", out=main, accumulate=True)
    res, *_ = general_gemm(X, dY, torch.float32, layout="NT", out=main, accumulate=True, beta=1.0)
    assert res is main
    assert rel_err(main, start.double() + 2 * _ref(X, dY, "NT")) < TOL[torch.bfloat16]


def test_general_gemm_bias_gradient(device):
    X, dY = _operands("NT", torch.float32, device)
    out, bias_grad, *_ = general_gemm(X, dY, layout="NT", grad=True, bias=torch.empty(dY.shape[-1], device=device))
    assert rel_err(out, _ref(X, dY, "NT")) < TOL[torch.float32]
    assert rel_err(bias_grad, dY.reshape(-1, dY.shape[-1]).double().sum(0)) < TOL[torch.float32]


def _fp8(t):
    return te.Float8CurrentScalingQuantizer(E4M3, device=t.device)(t)


def _values(q):
    return q.dequantize(dtype=torch.float32).double()


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_general_gemm_fp8_operands(device, layout):
    A, B = _operands(layout, torch.bfloat16, device, rows=(32,))
    qa, qb = _fp8(A), _fp8(B)
    out, *_ = general_gemm(qa, qb, torch.float32, layout=layout, use_split_accumulator=True)
    # The FP8 values are exact; what differs is the accumulation. The CPU
    # emulation adds the products in fp32 (k=32: far below 1e-6). Hopper's
    # FP8 tensor cores add products in an accumulator of about 14 mantissa
    # bits before cuBLASLt promotes the partial sums to fp32 (DeepSeek-V3
    # report, section 3.3.2): about 2^-14 relative per sum, so 2^-12 for
    # the whole tensor (measured on an H100: 4.6e-5).
    tol = 1e-6 if torch.device(device).type == "cpu" else 2.0 ** -12
    assert rel_err(out, _ref(_values(qa), _values(qb), layout)) < tol
    out_bf16, *_ = general_gemm(qa, qb, torch.bfloat16, layout=layout)
    assert out_bf16.dtype == torch.bfloat16
    assert rel_err(out_bf16, out) < TOL[torch.bfloat16]


def test_general_gemm_quantized_output(device):
    A, B = _operands("TN", torch.bfloat16, device, rows=(32,))
    qa, qb = _fp8(A), _fp8(B)
    quantizer = te.Float8CurrentScalingQuantizer(E4M3, device=device)
    quantized, *_ = general_gemm(qa, qb, torch.float32, quantization_params=quantizer)
    plain, *_ = general_gemm(qa, qb, torch.float32)
    assert isinstance(quantized, te.Float8Tensor)
    assert torch.equal(quantized.dequantize(), quantizer(plain).dequantize())


def test_general_gemm_through_the_alias_module():
    import importlib
    from transformer_engine_c import cpp_extensions
    assert importlib.import_module("transformer_engine_c.cpp_extensions.gemm").general_gemm is general_gemm
    assert cpp_extensions.__all__ == ["general_gemm"]


def test_general_gemm_refuses_what_it_does_not_do():
    A, B = _operands("TN", torch.float32, "cpu")
    cases = [
        (dict(layout="TT"), ValueError, "layout"),
        (dict(gelu=True), NotImplementedError, "gelu"),
        (dict(gelu_in=torch.empty(1)), NotImplementedError, "gelu_in"),
        (dict(alpha=2.0), NotImplementedError, "alpha"),
        (dict(beta=1.0), ValueError, "beta"),
        (dict(accumulate=True), ValueError, "accumulate"),
        (dict(ub=object()), NotImplementedError, "ub"),
        (dict(extra_output=torch.empty(1)), NotImplementedError, "extra_output"),
        (dict(bulk_overlap=True), NotImplementedError, "bulk_overlap"),
        (dict(out_dtype=torch.float16), NotImplementedError, "out_dtype"),
        (dict(out_dtype=torch.int32), NotImplementedError, "out_dtype"),
        (dict(quantization_params="fp8"), TypeError, "quantization_params"),
        (dict(out=torch.empty(5, 5)), ValueError, "out"),
        (dict(grad=True, bias=torch.empty(48)), NotImplementedError, "bias"),
    ]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            general_gemm(A, B, **kwargs)
    with pytest.raises(ValueError, match=r"A \(48, 32\) and B \(3, 8, 48\)"):
        general_gemm(A, torch.randn(3, 8, 48))
    with pytest.raises(TypeError, match="B has dtype torch.bfloat16"):
        general_gemm(A, B.bfloat16())
    with pytest.raises(TypeError, match="B has dtype torch.int64"):
        general_gemm(A, torch.ones(8, 32, dtype=torch.long))
    with pytest.raises(TypeError, match="A must be a torch.Tensor"):
        general_gemm([[1.0]], B)
    qa = _fp8(A.reshape(48, 32))
    with pytest.raises(TypeError, match="A is a Float8Tensor and B is not FP8"):
        general_gemm(qa, B, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        general_gemm(qa, _fp8(B.reshape(24, 32)))
    block = te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True)(A)
    with pytest.raises(NotImplementedError, match="A is a Float8BlockwiseQTensor"):
        general_gemm(block, B)


# ------------------------------------------------- activation recompute stash

@pytest.fixture
def fresh_state():
    G.reset()
    yield
    G.reset()


def _delayed_meta():
    recipe = DelayedScaling()
    meta = M.make_fp8_meta(recipe, 1, "cpu")
    meta["recipe"] = recipe
    fwd = meta["scaling_fwd"]
    fwd.scale.copy_(torch.tensor([2.0, 4.0, 8.0]))
    fwd.scale_inv.copy_(1 / fwd.scale)
    fwd.amax_history.uniform_()
    return meta


def _tensors(meta):
    fwd = meta["scaling_fwd"]
    return [fwd.amax_history.clone(), fwd.scale.clone(), fwd.scale_inv.clone()]


def _assert_tensors(meta, expected):
    for now, want in zip(_tensors(meta), expected):
        assert torch.equal(now, want)


def _step(meta, factor):
    """What an autocast exit does to the live tensors (in place)."""
    fwd = meta["scaling_fwd"]
    fwd.scale.mul_(factor)
    fwd.scale_inv.copy_(1 / fwd.scale)
    fwd.amax_history.add_(factor)


def test_recompute_stash_round_trip(fresh_state):
    meta = _delayed_meta()
    first = _tensors(meta)
    G.copy_forward_fp8_meta_tensors_for_recompute(meta)  # checkpointed forward 1
    _step(meta, 2.0)
    second = _tensors(meta)
    G.copy_forward_fp8_meta_tensors_for_recompute(meta)  # checkpointed forward 2
    _step(meta, 3.0)
    latest = _tensors(meta)
    assert RECOMPUTE_POSITION_KEY in meta
    assert len(G.fp8_tensors_recompute_buffer[meta[RECOMPUTE_POSITION_KEY]]) == 2

    # recomputes run oldest first; each casts with its forward's tensors, then the latest come back
    for stashed in (first, second):
        G.get_old_fp8_meta_tensors_for_recompute(meta)
        _assert_tensors(meta, stashed)
        G.restore_fp8_meta_tensors(meta)
        _assert_tensors(meta, latest)
    assert not G.fp8_tensors_recompute_buffer[meta[RECOMPUTE_POSITION_KEY]]


def test_recompute_stash_is_per_meta_and_delayed_only(fresh_state):
    a, b = _delayed_meta(), _delayed_meta()
    b["scaling_fwd"].scale.fill_(16.0)
    want_b = _tensors(b)
    G.copy_forward_fp8_meta_tensors_for_recompute(a)
    G.copy_forward_fp8_meta_tensors_for_recompute(b)
    assert a[RECOMPUTE_POSITION_KEY] != b[RECOMPUTE_POSITION_KEY]
    _step(b, 5.0)
    G.get_old_fp8_meta_tensors_for_recompute(b)
    _assert_tensors(b, want_b)

    current = {"recipe": Float8CurrentScaling()}  # other recipes: nothing to stash, nothing to restore
    G.copy_forward_fp8_meta_tensors_for_recompute(current)
    G.get_old_fp8_meta_tensors_for_recompute(current)
    G.restore_fp8_meta_tensors(current)
    assert current == {"recipe": current["recipe"]}


def test_recompute_stash_after_a_reset_starts_a_new_queue(fresh_state):
    old = _delayed_meta()
    G.copy_forward_fp8_meta_tensors_for_recompute(old)
    G.reset()
    meta = _delayed_meta()
    G.copy_forward_fp8_meta_tensors_for_recompute(meta)  # takes position 0 again
    assert meta[RECOMPUTE_POSITION_KEY] == old[RECOMPUTE_POSITION_KEY] == 0
    with pytest.raises(RuntimeError, match="no stashed forward scales"):
        G.get_old_fp8_meta_tensors_for_recompute(old)  # not meta's queue
    want = _tensors(old)
    G.copy_forward_fp8_meta_tensors_for_recompute(old)
    _step(old, 2.0)
    G.get_old_fp8_meta_tensors_for_recompute(old)
    _assert_tensors(old, want)
    assert len(G.fp8_tensors_recompute_buffer) == 2


def test_recompute_stash_is_bounded(fresh_state, monkeypatch):
    import transformer_engine_c.quantization as Q
    monkeypatch.setattr(Q, "RECOMPUTE_STASH", 2)
    meta = _delayed_meta()
    stashed = collections.deque(maxlen=2)
    for i in range(3):
        stashed.append(_tensors(meta))
        G.copy_forward_fp8_meta_tensors_for_recompute(meta)
        _step(meta, 2.0)
    for want in stashed:  # the oldest was dropped
        G.get_old_fp8_meta_tensors_for_recompute(meta)
        _assert_tensors(meta, want)


def test_recompute_stash_errors_name_what_is_wrong(fresh_state):
    for fn in (G.copy_forward_fp8_meta_tensors_for_recompute, G.get_old_fp8_meta_tensors_for_recompute,
               G.restore_fp8_meta_tensors):
        with pytest.raises(TypeError, match="fp8_meta must be a module's fp8_meta dict"):
            fn(None)
        with pytest.raises(ValueError, match="'scaling_fwd'"):
            fn({"recipe": DelayedScaling()})
    meta = _delayed_meta()
    with pytest.raises(RuntimeError, match="copy_forward_fp8_meta_tensors_for_recompute stashes them"):
        G.get_old_fp8_meta_tensors_for_recompute(meta)
    with pytest.raises(RuntimeError, match="get_old_fp8_meta_tensors_for_recompute keeps them"):
        G.restore_fp8_meta_tensors(meta)
    G.copy_forward_fp8_meta_tensors_for_recompute(meta)
    G.get_old_fp8_meta_tensors_for_recompute(meta)
    with pytest.raises(RuntimeError, match="the recompute ran twice"):
        G.get_old_fp8_meta_tensors_for_recompute(meta)
