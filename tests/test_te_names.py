"""The transformer_engine.pytorch names that TE's own tests and Megatron-Core
touch, as `import transformer_engine_c as te` serves them (single process):
constructor signatures in TE 2.x's positional order, the FP8 stand-ins
(disabled: no-op; enabled: NotImplementedError naming FP8), the recipes as
plain data, UserBufferQuantizationMode, restore_from_saved /
restore_from_func_ctx with TE's signatures, symmetric_ar_type, and ub_* flags
that do not apply to a layer (ignored, at most one warning)."""
import inspect
import warnings

import pytest
import torch

import transformer_engine_c as te

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
    if not torch.cuda.is_available():
        assert ok is True and "emulated on the CPU" in reason
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
