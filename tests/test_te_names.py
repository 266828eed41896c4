"""The transformer_engine.pytorch names that TE's own tests and Megatron-Core
touch, as `import transformer_engine_c as te` serves them (single process):
constructor signatures in TE 2.x's positional order, the FP8 stand-ins
(disabled: no-op; enabled: NotImplementedError naming FP8), the recipes as
plain data, UserBufferQuantizationMode, restore_from_saved /
restore_from_func_ctx with TE's signatures, symmetric_ar_type, and ub_* flags
that do not apply to a layer (ignored, at most one warning)."""
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c.cpp_extensions import general_gemm

# The list (TE 2.x's order).
LINEAR_ORDER = ["in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "tp_size",
                "get_rng_state_tracker", "rng_tracker_name", "init_method", "bias", "return_bias", "params_dtype",
                "parallel_mode", "parameters_split", "device", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad",
                "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type",
                "save_original_input", "name"]
LAYERNORM_LINEAR_ORDER = ["in_features", "out_features", "eps", "sequence_parallel", "fuse_wgrad_accumulation",
                          "tp_group", "tp_size", "get_rng_state_tracker", "init_method", "bias", "normalization",
                          "return_bias", "params_dtype", "parallel_mode", "return_layernorm_output",
                          "return_layernorm_output_gathered", "parameters_split", "zero_centered_gamma", "device",
                          "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad", "ub_bulk_dgrad",
                          "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "name"]
DEFAULTS = {"sequence_parallel": False, "fuse_wgrad_accumulation": False, "tp_group": None, "tp_size": 1,
            "get_rng_state_tracker": None, "init_method": None, "bias": True, "return_bias": False,
            "params_dtype": None, "parallel_mode": None, "parameters_split": None, "ub_overlap_ag": False,
            "ub_overlap_rs": False, "ub_overlap_rs_dgrad": False, "ub_bulk_dgrad": False, "ub_bulk_wgrad": False,
            "ub_name": None, "delay_wgrad_compute": False, "symmetric_ar_type": None, "name": None}


def _positional(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)], params


@pytest.mark.parametrize("cls,order,extra_defaults", [
    (te.Linear, LINEAR_ORDER, {"rng_tracker_name": None, "save_original_input": False}),
    (te.LayerNormLinear, LAYERNORM_LINEAR_ORDER,
     {"eps": 1e-5, "normalization": "LayerNorm", "return_layernorm_output": False,
      "return_layernorm_output_gathered": False, "zero_centered_gamma": False}),
])
def test_signature_in_te_order(cls, order, extra_defaults):
    positional, params = _positional(cls)
    assert [p.name for p in positional] == order, f"{cls.__name__}: positional order differs from TE 2.x's"
    want = {**{k: v for k, v in DEFAULTS.items() if k in order}, **extra_defaults}
    got = {p.name: p.default for p in params}
    for k, v in want.items():
        assert got[k] == v, f"{cls.__name__}({k}=...) defaults to {got[k]!r}, TE's default is {v!r}"
    # our own arguments are keyword-only, after TE's
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params[len(order):])


def test_positional_call_means_what_it_means_in_te():
    m = te.Linear(16, 8, False, device="cpu")  # third: sequence_parallel, not bias
    assert m.bias is not None and tuple(m.bias.shape) == (8,)
    m = te.Linear(16, 8, False, False, None, 1, None, None, None, False, device="cpu")  # bias=False, tenth
    assert getattr(m, "bias", None) is None or m.bias.numel() == 0
    assert not m.use_bias
    m = te.LayerNormLinear(16, 8, 1e-3, device="cpu")  # third: eps
    assert m.eps == 1e-3
    m = te.LayerNormLinear(16, 8, 1e-5, False, False, None, 1, None, None, True, "RMSNorm", device="cpu")
    assert m.normalization == "RMSNorm" and getattr(m, "layer_norm_bias", None) is None


@pytest.mark.parametrize("ctx", ["fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init"])
def test_fp8_contexts(ctx):
    fn = getattr(te, ctx)
    with fn(enabled=False):  # a no-op: the layers run as without it
        m = te.Linear(16, 16, device="cpu")
        y = m(torch.randn(4, 16))
    assert y.dtype == torch.float32 and y.shape == (4, 16)
    if ctx in ("fp8_autocast", "autocast"):  # the layer computes in FP8 under it, and without it after
        x = torch.randn(16, 16)
        with fn(enabled=True):
            y8 = m(x)
        y = m(x)
        assert y8.shape == y.shape == (16, 16) and not torch.equal(y8, y)
    else:  # the weights are built in FP8 (tests/test_fp8_params.py)
        with fn(enabled=True):
            m8 = te.Linear(16, 16, device="cpu")
        assert type(m8.weight).__name__ == "Float8Tensor" and m8.weight._data.dtype == torch.uint8


def test_fp8_contexts_take_te_keywords():
    recipe = te.recipe.DelayedScaling(fp8_format=te.recipe.Format.HYBRID, amax_history_len=32,
                                      amax_compute_algo="max")
    with te.fp8_autocast(enabled=False, fp8_recipe=recipe, fp8_group=None):
        pass
    with te.fp8.fp8_autocast(enabled=False, fp8_recipe=recipe):
        pass
    with te.fp8_model_init(enabled=False, recipe=None, preserve_high_precision_init_val=False):
        pass
    with te.fp8.fp8_model_init(enabled=False):
        pass
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=None):
        assert te.fp8.FP8GlobalStateManager.get_fp8_recipe() is recipe


def test_recipes_take_te_fields():
    r = te.recipe.DelayedScaling(fp8_format=te.recipe.Format.HYBRID, amax_history_len=32, amax_compute_algo="max")
    assert r.fp8_format == te.recipe.Format.HYBRID and r.amax_history_len == 32 and r.amax_compute_algo == "max"
    assert te.recipe.Format.E4M3 != te.recipe.Format.HYBRID
    for cls in (te.recipe.Float8CurrentScaling, te.recipe.MXFP8BlockScaling, te.recipe.Float8BlockScaling,
                te.recipe.DelayedScaling):
        assert isinstance(cls(), te.recipe.Recipe), cls
    assert te.recipe.Float8CurrentScaling(fp8_format=te.recipe.Format.E4M3).fp8_format == te.recipe.Format.E4M3
    assert isinstance(te.fp8.get_default_fp8_recipe(), te.recipe.Recipe)


def test_fp8_global_state():
    ok, reason = te.fp8.FP8GlobalStateManager.is_fp8_available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    if not torch.cuda.is_available():  # emulated on the CPU: available, TE's empty reason
        assert ok is True and reason == ""
    assert te.fp8.FP8GlobalStateManager.is_fp8_enabled() is False
    with te.fp8_autocast(enabled=True):
        assert te.fp8.FP8GlobalStateManager.is_fp8_enabled() is True
    assert te.fp8.FP8GlobalStateManager.is_fp8_enabled() is False


def test_userbuffer_quantization_mode():
    mode = te.module.base.UserBufferQuantizationMode
    assert mode.NONE != mode.FP8
    assert te.module.base.initialize_ub and te.module.base.get_ub and te.module.base.destroy_ub
    base = te.module.base
    # TE's registry: one set of communicators per mode; get_ub(name, use_fp8) picks one
    for kw, none, fp8 in (({"quantization_modes": [mode.FP8]}, False, True), ({"use_fp8": True}, False, True),
                          ({"quantization_modes": [mode.NONE, mode.FP8]}, True, True), ({}, True, False)):
        base.initialize_ub([8, 16], 1, device="cpu", **kw)
        try:
            for use_fp8, made in ((False, none), (True, fp8)):
                if not made:
                    with pytest.raises(KeyError, match="quantization mode"):
                        base.get_ub("qkv_fprop", use_fp8=use_fp8)
                    continue
                gather, rs = base.get_ub("qkv_fprop", use_fp8), base.get_ub("proj_fprop", use_fp8)
                # FP8 mode: the all-gathering communicators hold FP8 bytes, the reduce-scattering ones bf16 partials
                assert gather.dtype is (torch.uint8 if use_fp8 else torch.bfloat16), kw
                assert rs.dtype is torch.bfloat16 and base.get_ub("proj_dgrad", use_fp8).dtype is gather.dtype
                if none and fp8:
                    assert base.get_ub("qkv_fprop", False) is not base.get_ub("qkv_fprop", True)
        finally:
            base.destroy_ub()
    for bad, err in (("fp8", TypeError), ([], TypeError), (["int8"], ValueError)):
        with pytest.raises(err, match="quantization_modes"):
            base.initialize_ub([8, 16], 1, device="cpu", quantization_modes=bad)


def test_fp8_layer_construction_refuses_recipes_without_fp8_weights():
    with pytest.raises(NotImplementedError, match="recipe=MXFP8BlockScaling"):
        with te.fp8_model_init(enabled=True, recipe=te.recipe.MXFP8BlockScaling()):
            te.Linear(16, 8, device="cpu")


class _Keep(torch.autograd.Function):
    """A Function saving through prepare_for_saving and restoring through
    restore_from_func_ctx, as TE's modules do."""

    @staticmethod
    def forward(ctx, a, b):
        to_save, ctx.tensor_objects = te.prepare_for_saving(a, None, b)
        ctx.save_for_backward(*to_save)
        return a * b

    @staticmethod
    def backward(ctx, dy):
        a, none, b = te.restore_from_func_ctx(ctx)
        assert none is None and ctx.tensor_objects is None
        return dy * b, dy * a


def test_restore_from_func_ctx():
    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    _Keep.apply(a, b).sum().backward()
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())

    class NoObjects:
        saved_tensors = ()

    with pytest.raises(AttributeError, match="tensor_objects"):
        te.restore_from_func_ctx(NoObjects())


def test_restore_from_saved_return_saved_tensors():
    a, b, extra = torch.randn(3), torch.randn(4), torch.randn(2)
    to_save, objects = te.prepare_for_saving(a, None, b)
    saved = list(to_save) + [extra]  # something saved after them
    restored, rest = te.restore_from_saved(objects, saved, return_saved_tensors=True)
    assert restored[0] is a and restored[1] is None and restored[2] is b
    assert len(rest) == 1 and rest[0] is extra
    to_save, objects = te.prepare_for_saving(a, None, b)  # (each result is restored once)
    again = te.restore_from_saved(objects, list(to_save))  # without: the objects alone
    assert len(again) == 3 and all(x is y for x, y in zip(again, restored))
    # TE's own form: a list of None / tensors, each restored from the next saved tensor
    restored, rest = te.restore_from_saved([a, None], [a, None, extra], return_saved_tensors=True)
    assert restored[0] is a and restored[1] is None and rest == [extra]


def test_symmetric_ar_type():
    te.Linear(16, 8, symmetric_ar_type=None, device="cpu")
    for cls in (te.Linear, te.LayerNormLinear):
        with pytest.raises(NotImplementedError, match="multimem_all_reduce"):
            cls(16, 8, symmetric_ar_type="multimem_all_reduce", device="cpu")


@pytest.mark.parametrize("flags", [{"ub_overlap_rs": True}, {"ub_overlap_ag": True, "ub_overlap_rs": True},
                                   {"ub_bulk_dgrad": True, "ub_bulk_wgrad": True, "ub_overlap_rs_dgrad": True}])
@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear])
def test_inapplicable_ub_flags_are_ignored(cls, flags):
    """Without sequence parallelism (and at tp_size 1) no ub_* flag applies:
    TE builds the layer anyway; we do too, with at most one warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = cls(16, 8, parallel_mode="column", ub_name="qkv", device="cpu", **flags)
    assert sum(issubclass(w.category, UserWarning) for w in caught) <= 1, [str(w.message) for w in caught]
    ref = cls(16, 8, parallel_mode="column", device="cpu")
    ref.load_state_dict(m.state_dict())
    x = torch.randn(4, 16)
    assert torch.equal(m(x), ref(x))


def test_autocast_bf16_with_fp32_params():
    """torch.autocast: fp32 master parameters, bf16 activations and GEMMs,
    fp32 parameter grads (as TE honours it)."""
    m = te.LayerNormLinear(32, 24, device="cpu")
    x = torch.randn(6, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m.weight.dtype == torch.float32 and m.weight.grad.dtype == torch.float32
    assert m.layer_norm_weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    # against the same math in float64 on bf16-rounded GEMM operands
    xr = x.detach().double().requires_grad_()
    n = torch.nn.functional.layer_norm(xr, (32,), m.layer_norm_weight.double(), m.layer_norm_bias.double(), 1e-5)
    ref = torch.nn.functional.linear(n.bfloat16().double(), m.weight.detach().bfloat16().double(), m.bias.double())
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("split", [("query_", "key_", "value_"), {"query": 4, "key": 2, "value": 6}])
def test_parameters_split(split):
    """TE's parameters_split: named slices of weight/bias along dim 0 (names end
    in _weight / _bias, trailing underscores stripped) acting as one GEMM."""
    m = te.Linear(8, 12, parameters_split=split, device="cpu", name="qkv")
    names = [n for n, _ in m.named_parameters()]
    # TE registers every weight slice, then every bias slice
    assert names == ["query_weight", "key_weight", "value_weight", "query_bias", "key_bias", "value_bias"], names
    if isinstance(split, dict):
        assert [tuple(getattr(m, f"{k}_weight").shape) for k in split] == [(4, 8), (2, 8), (6, 8)]
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.cat([getattr(m, f"{k}_weight") for k in ("query", "key", "value")])
    b = torch.cat([getattr(m, f"{k}_bias") for k in ("query", "key", "value")])
    y = m(x)
    ref = torch.nn.functional.linear(x.detach().double(), w.detach().double(), b.detach().double())
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
    y.backward(torch.ones_like(y))
    assert torch.allclose(m.key_bias.grad, torch.full_like(m.key_bias, 5.0))
    assert m.name == "qkv"


# ------------------------------------------------- names TE's test_numerics.py and Accelerate import

def test_utils_init_methods_and_mask_func():
    torch.manual_seed(0)
    w = torch.empty(400, 500)
    assert te.utils.init_method_normal(0.02)(w) is w
    assert abs(w.std().item() - 0.02) < 0.02 * 0.02 and abs(w.mean().item()) < 1e-3
    te.utils.scaled_init_method_normal(0.02, 8)(w)  # N(0, sigma / sqrt(2 * num_layers))
    assert abs(w.std().item() - 0.02 / 4) < 0.02 / 4 * 0.02
    scores = torch.randn(2, 3, 4, 4)
    mask = torch.rand(2, 1, 4, 4) > 0.5
    out = te.utils.attention_mask_func(scores, mask)
    assert out is scores  # in place, as TE's
    assert (scores[mask.expand_as(scores)] == -10000.0).all() and (scores[~mask.expand_as(scores)] != -10000.0).all()


def test_device_queries():
    cc = te.get_device_compute_capability()
    assert isinstance(cc, tuple) and len(cc) == 2
    if torch.cuda.is_available():
        assert cc == torch.cuda.get_device_capability()
        assert te.is_bf16_available() is (cc[0] >= 8)
    else:  # the CPU: no compute capability; bf16 computed by the CPU engine
        assert cc == (0, 0) and not cc >= (8, 0)
        assert te.is_bf16_available() is True and te.is_bf16_available(return_reason=True) == (True, "")


def _as_gpu(monkeypatch, cc, cuda="13.0", name="NVIDIA H200"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.version, "cuda", cuda)


MXFP8_TE = "Device compute capability 10.0 or higher required for MXFP8 execution."
BLOCK_TE = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


def test_support_checks_answer_as_te_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fp8 = te.fp8
    assert fp8.check_fp8_support() == (True, "")  # FP8 emulated on the CPU; TE's empty reason when available
    assert fp8.check_fp8_block_scaling_support() == (True, "")
    assert fp8.check_mxfp8_support() == (False, MXFP8_TE)
    assert fp8.check_nvfp4_support()[0] is False
    assert te.is_fp8_available(return_reason=True) == (True, "") and te.is_mxfp8_available() is False
    assert te.is_fp8_block_scaling_available() is True and te.is_nvfp4_available() is False
    G = fp8.FP8GlobalStateManager
    assert G.is_mxfp8_available() == (False, MXFP8_TE) and G.is_fp8_available() == (True, "")


def test_support_checks_answer_as_te_on_an_h200(monkeypatch):
    _as_gpu(monkeypatch, (9, 0))
    fp8 = te.fp8
    assert fp8.check_fp8_support() == (True, "")
    assert fp8.check_fp8_block_scaling_support() == (True, "")
    assert fp8.check_mxfp8_support() == (False, MXFP8_TE)  # Accelerate reads this for use_mxfp8_block_scaling
    assert isinstance(fp8.get_default_fp8_recipe(), te.recipe.DelayedScaling)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert fp8.check_fp8_block_scaling_support() == (False, BLOCK_TE)
    _as_gpu(monkeypatch, (8, 0), name="A100")
    ok, reason = fp8.check_fp8_support()
    assert not ok and reason.startswith("Device compute capability 8.9 or higher required for FP8 execution")
    assert fp8.check_fp8_block_scaling_support() == (False, BLOCK_TE)
    _as_gpu(monkeypatch, (10, 0), name="B200")  # TE would offer MXFP8 here; this package does not
    ok, reason = fp8.check_mxfp8_support()
    assert not ok and "not offered" in reason


def test_quantizers_take_te_dtype():
    from transformer_engine_c import DType
    assert DType.kFloat8E4M3 == 7 and DType.kFloat8E5M2 == 8 and DType.kBFloat16 == 6  # transformer_engine.h
    x = torch.randn(16, 32)
    q = te.Float8Quantizer(torch.ones(1).squeeze(), torch.zeros(1).squeeze(), DType.kFloat8E4M3)
    assert q.dtype is torch.float8_e4m3fn
    t = q(x)
    assert isinstance(t, te.Float8Tensor) and isinstance(t, te.QuantizedTensor)
    assert isinstance(t, te.Float8TensorStorage) and isinstance(t, te.QuantizedTensorStorage)
    assert not isinstance(t, (te.MXFP8Tensor, te.NVFP4Tensor, te.MXFP8TensorStorage))
    ref = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(t.dequantize(), ref)
    c = te.Float8CurrentScalingQuantizer(fp8_dtype=DType.kFloat8E5M2, device="cpu")
    assert c.dtype is torch.float8_e5m2 and isinstance(c, te.Quantizer)
    b = te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False)
    assert b.dtype is torch.float8_e4m3fn and isinstance(b, te.Quantizer)
    with pytest.raises(ValueError, match="FP4"):
        te.Float8CurrentScalingQuantizer(DType.kFloat4E2M1, "cpu")


@pytest.mark.parametrize("cls", ["MXFP8Tensor", "NVFP4Tensor", "MXFP8TensorStorage", "NVFP4TensorStorage"])
def test_blackwell_tensors_refuse_construction(cls):
    c = getattr(te, cls) if hasattr(te, cls) else getattr(te.tensor, cls)
    with pytest.raises(NotImplementedError, match=f"{cls[:5]}.*Blackwell"):
        c()
    assert issubclass(c, te.QuantizedTensorStorage)
    assert not isinstance(te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, "cpu")(torch.ones(2, 2)), c)


@pytest.mark.parametrize("make", [lambda: te.MXFP8Quantizer(fp8_dtype=te.DType.kFloat8E4M3),
                                  lambda: te.MXFP8Quantizer(torch.float8_e5m2, rowwise=True, columnwise=False),
                                  lambda: te.NVFP4Quantizer(),
                                  lambda: te.NVFP4Quantizer(fp4_dtype=te.DType.kFloat4E2M1, with_rht=True,
                                                            with_2d_quantization=True, stochastic_rounding=False)],
                         ids=["mxfp8", "mxfp8-e5m2-rowwise", "nvfp4", "nvfp4-options"])
def test_blackwell_quantizers_construct_as_te_and_refuse_to_quantize(make):
    """TE's MXFP8 / NVFP4 quantizers construct on any device (TE's
    test_numerics.py builds them in a parametrize list and skips where the
    format is unavailable); quantizing with one is what raises, naming the
    format."""
    q = make()
    assert isinstance(q, te.Quantizer) and q.rowwise_usage is True
    fmt = type(q).__name__[:5]
    assert fmt in repr(q)
    q.set_usage(columnwise=False)
    assert q.columnwise_usage is False and q.copy().columnwise_usage is False
    x = torch.randn(32, 32)
    for use in (lambda: q(x), lambda: q.quantize(x), lambda: q.make_empty((32, 32)),
                lambda: q.update_quantized(x, x)):
        with pytest.raises(NotImplementedError, match=f"{fmt}.*Blackwell.*not offer"):
            use()
    with pytest.raises(NotImplementedError, match=f"{fmt}.*Blackwell"):
        general_gemm(torch.randn(8, 16), torch.randn(4, 16), quantization_params=q)
    assert (te.fp8.check_mxfp8_support() if fmt == "MXFP8" else te.fp8.check_nvfp4_support())[0] is False


def test_blackwell_quantizers_check_their_dtype():
    with pytest.raises(ValueError, match="MXFP8Quantizer: fp8_dtype"):
        te.MXFP8Quantizer(torch.float32)
    with pytest.raises(ValueError, match="NVFP4Quantizer: fp4_dtype"):
        te.NVFP4Quantizer(te.DType.kFloat8E4M3)


def test_inference_params():
    p = te.InferenceParams(2, 64, num_heads_kv=4, head_dim_k=16, dtype=torch.bfloat16)
    assert p.max_batch_size == 2 and p.max_sequence_length == 64 and p.input_qkv_format == "bshd"
    for call in (lambda: p.pre_step({1: 1}), lambda: p.allocate_memory(1), lambda: p.reset(),
                 lambda: p.step(1, None, None, "bshd")):
        with pytest.raises(NotImplementedError, match="InferenceParams"):
            call()
    with pytest.raises(ValueError, match="max_batch_size"):
        te.InferenceParams(0, 64)
    attn = te.DotProductAttention(2, 8)
    q = torch.randn(4, 1, 2, 8)
    with pytest.raises(NotImplementedError, match="inference_params"):
        attn(q, q, q, inference_params=p)


def test_te_names_through_the_alias():
    """What TE's tests/pytorch/test_numerics.py and Accelerate import, under
    TE's module paths (a fresh interpreter: the alias changes the import
    system)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = """
import transformer_engine_c as t
t.install_as_transformer_engine()
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV
from transformer_engine.pytorch.utils import init_method_normal, scaled_init_method_normal, attention_mask_func
from transformer_engine.pytorch import (autocast, quantized_model_init, DotProductAttention, LayerNormLinear,
    LayerNormMLP, Linear, RMSNorm, LayerNorm, Float8Quantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer,
    get_device_compute_capability, is_fp8_available, is_mxfp8_available, is_fp8_block_scaling_available,
    is_bf16_available, is_nvfp4_available, DType, QuantizedTensor, InferenceParams, get_default_recipe)
from transformer_engine.pytorch import checkpoint as te_checkpoint
from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.fp8 import check_fp8_support, check_mxfp8_support, check_fp8_block_scaling_support
import transformer_engine.pytorch.tensor as tensor
from transformer_engine.common import recipe
assert UNSAFE_PICKLE_EXTRA_STATE_ENV == "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
te_names = ["Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer",
            "NVFP4Quantizer", "QuantizedTensorStorage", "Float8TensorStorage", "MXFP8TensorStorage",
            "Float8BlockwiseQTensorStorage", "NVFP4TensorStorage", "QuantizedTensor", "Float8Tensor", "MXFP8Tensor",
            "Float8BlockwiseQTensor", "NVFP4Tensor", "prepare_for_saving", "restore_from_saved"]
missing = [n for n in te_names if not hasattr(tensor, n)]
assert not missing and sorted(tensor.__all__) == sorted(te_names), missing
assert get_device_compute_capability() >= (0, 0) and isinstance(is_bf16_available(), bool)
# what test_numerics.py builds at module level: support answers and quantizers in parametrize lists
mxfp8_available, reason_for_no_mxfp8 = is_mxfp8_available(return_reason=True)
assert mxfp8_available is False and reason_for_no_mxfp8
assert is_nvfp4_available() is False
import torch
quantizers = [Float8CurrentScalingQuantizer(fp8_dtype=DType.kFloat8E4M3, device="cpu"),
              MXFP8Quantizer(fp8_dtype=DType.kFloat8E4M3),
              Float8Quantizer(torch.ones(1).squeeze(), torch.ones(1).squeeze(), DType.kFloat8E4M3),
              tensor.NVFP4Quantizer()]
assert check_mxfp8_support()[0] is False and all(isinstance(q, tensor.Quantizer) for q in quantizers)
print("OK")
"""
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


# TE 2.x's parameter registration order (its module constructors: the norm's
# parameters first, then each GEMM's; a split Linear's weights, then its
# biases; GroupedLinear's weight{i}, bias{i} per GEMM), which is also the
# state_dict's, followed by _extra_state.
PARAM_ORDER = [
    (lambda: te.Linear(16, 8, device="cpu"), ["weight", "bias"]),
    (lambda: te.Linear(16, 8, bias=False, device="cpu"), ["weight"]),
    (lambda: te.Linear(16, 12, parameters_split=("q", "k", "v"), device="cpu"),
     ["q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias"]),
    (lambda: te.LayerNormLinear(16, 8, device="cpu"), ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]),
    (lambda: te.LayerNormLinear(16, 8, normalization="RMSNorm", bias=False, device="cpu"),
     ["layer_norm_weight", "weight"]),
    (lambda: te.LayerNormLinear(16, 12, parameters_split={"q": 4, "kv": 8}, device="cpu"),
     ["layer_norm_weight", "layer_norm_bias", "q_weight", "kv_weight", "q_bias", "kv_bias"]),
    (lambda: te.LayerNormMLP(16, 32, device="cpu"),
     ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]),
    (lambda: te.LayerNormMLP(16, 32, activation="swiglu", device="cpu"),
     ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]),
    (lambda: te.LayerNormMLP(16, 32, normalization="RMSNorm", bias=False, device="cpu"),
     ["layer_norm_weight", "fc1_weight", "fc2_weight"]),
    (lambda: te.LayerNorm(16, device="cpu"), ["weight", "bias"]),
    (lambda: te.RMSNorm(16, device="cpu"), ["weight"]),
    (lambda: te.GroupedLinear(3, 16, 8, device="cpu"), ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]),
    (lambda: te.GroupedLinear(2, 16, 8, bias=False, device="cpu"), ["weight0", "weight1"]),
]


@pytest.mark.parametrize("make,order", PARAM_ORDER, ids=lambda v: None if callable(v) else "-".join(v[:3]))
def test_parameter_order_is_te(make, order):
    m = make()
    assert [n for n, _ in m.named_parameters()] == order
    assert list(m.state_dict()) == order + ["_extra_state"]
    # a state_dict saved by another instance loads, strict, and the order survives it
    other = make()
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn_like(p))
    m.load_state_dict(other.state_dict(), strict=True)
    assert [n for n, _ in m.named_parameters()] == order
    for (n, p), (_, q) in zip(m.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling"])
def test_parameter_order_with_fp8_weights(recipe):
    """FP8 primary weights replace the weights in place: TE's order stays."""
    with te.quantized_model_init(enabled=True, recipe=getattr(te.recipe, recipe)()):
        m = te.LayerNormMLP(16, 32, device="cpu")
        lin = te.Linear(16, 32, parameters_split=("a", "b"), device="cpu")
    assert [n for n, _ in m.named_parameters()] == PARAM_ORDER[6][1]
    assert type(m.fc1_weight).__name__ == "Float8Tensor" and type(m.fc2_weight).__name__ == "Float8Tensor"
    assert [n for n, _ in lin.named_parameters()] == ["a_weight", "b_weight", "a_bias", "b_bias"]


TE_MODULES = [lambda: te.Linear(16, 16, device="cpu"), lambda: te.LayerNormLinear(16, 16, device="cpu"),
              lambda: te.LayerNormMLP(16, 32, device="cpu"), lambda: te.GroupedLinear(2, 16, 16, device="cpu"),
              lambda: te.DotProductAttention(2, 8)]


@pytest.mark.parametrize("make", TE_MODULES)
def test_fp8_meta_from_construction(make):
    """TE's modules (TransformerEngineBaseModule's) have fp8_meta from their
    constructor: fp8_checkpoint False and fp8_group None, no tensors yet."""
    m = make()
    assert m.fp8_meta == {"fp8_checkpoint": False, "fp8_group": None}
    assert m.state_dict()["_extra_state"].numel() == 0  # nothing to save yet, as TE
    assert te.LayerNorm(16).__dict__.get("fp8_meta") is None  # TE's norms are operations, without one


@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling"])
def test_fp8_meta_after_an_fp8_call(recipe):
    m = te.Linear(16, 16, device="cpu")
    meta = m.fp8_meta
    r = getattr(te.recipe, recipe)()
    with te.autocast(enabled=True, recipe=r):
        m(torch.randn(16, 16)).sum().backward()
    meta = m.fp8_meta
    assert meta["recipe"] is r and meta["fp8_checkpoint"] is True and meta["fp8_group"] is None
    if recipe == "DelayedScaling":  # TE's delayed-scaling layout, made at the first FP8 call
        assert meta["num_gemms"] == 1 and meta["fp8_max_fwd"] == 448.0
        assert meta["scaling_fwd"].scale.shape == (3,) and meta["scaling_bwd"].amax_history.shape == (1024, 2)
    extra = te.module._extra_state.loads(bytes(m.state_dict()["_extra_state"].tolist()))
    assert extra["extra_fp8_variables"]["fp8_checkpoint"] is True
    fresh = te.Linear(16, 16, device="cpu")
    fresh.load_state_dict(m.state_dict())
    assert fresh.fp8_meta["recipe"] == r
