"""Recipes, delayed scaling's fp8_meta and update rule against hand-computed
values (amax 0 / inf / NaN keep the old scale; margin; max / most_recent /
callables; the history roll), and the autocast state machine (nesting,
state restore, the update at the outermost exit with grad on only, the
unsupported recipes, the layers' refusal). CPU only: no device work."""
import math

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c import _fp8_meta as M
from transformer_engine_c.quantization import FP8GlobalStateManager as G
from transformer_engine_c.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                                         MXFP8BlockScaling, NVFP4BlockScaling)
from transformer_engine_c.tensor.float8_tensor import Float8Quantizer

FLT_MAX = torch.finfo(torch.float32).max


@pytest.fixture(autouse=True)
def fresh_state():
    G.reset()
    yield
    G.reset()


# ---------------------------------------------------------------- recipes


def test_recipe_defaults_are_te_2x():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == \
        (0, Format.HYBRID, 1024, "max", True)
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344
    c = Float8CurrentScaling()
    assert c.fp8_gemm_fprop.use_split_accumulator is False and c.fp8_gemm_dgrad.use_split_accumulator is True
    assert c.fp8_quant_fwd_inp.power_2_scale is False and c.fp8_quant_bwd_grad.amax_epsilon == 0.0
    b = Float8BlockScaling()
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.fp8_quant_fwd_weight.power_2_scale) == (1, 2, True)


@pytest.mark.parametrize("kwargs, match", [
    ({"fp8_format": Format.E5M2}, "pure E5M2"),
    ({"amax_history_len": 0}, "amax_history_len must be an int >= 1"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo must be 'max', 'most_recent' or a callable"),
    ({"margin": -1}, "margin must be a number >= 0"),
    ({"scaling_factor_compute_algo": 3}, "scaling_factor_compute_algo must be None or a callable"),
])
def test_delayed_scaling_refuses_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DelayedScaling(**kwargs)


def test_fp8_torch_dtypes():
    dt = te.quantization.get_fp8_torch_dtype
    assert dt(DelayedScaling(), True) is torch.float8_e4m3fn and dt(DelayedScaling(), False) is torch.float8_e5m2
    assert dt(DelayedScaling(fp8_format=Format.E4M3), False) is torch.float8_e4m3fn


def test_current_scaling_refuses_e5m2():
    with pytest.raises(ValueError, match="pure E5M2"):
        Float8CurrentScaling(fp8_format=Format.E5M2)


@pytest.mark.parametrize("recipe, name", [(MXFP8BlockScaling(), "MXFP8BlockScaling is a Blackwell format"),
                                          (NVFP4BlockScaling(), "NVFP4BlockScaling is a Blackwell format")])
def test_unsupported_recipes_raise_naming_themselves(recipe, name):
    with pytest.raises(NotImplementedError, match=name):
        with te.autocast(enabled=True, recipe=recipe):
            pass
    assert G.AUTOCAST_DEPTH == 0 and not G.is_fp8_enabled()
    with te.autocast(enabled=False, recipe=recipe):  # disabled: constructing and passing it is fine
        pass


# ------------------------------------------------------- the update rule


def meta_with(history, scale, recipe):
    meta = M.FP8TensorMeta(len(scale), len(history))
    meta.amax_history.copy_(torch.tensor(history, dtype=torch.float32))
    meta.scale.copy_(torch.tensor(scale, dtype=torch.float32))
    return meta


def test_make_fp8_meta_layout():
    meta = M.make_fp8_meta(DelayedScaling(amax_history_len=31), num_gemms=2)
    assert meta["scaling_fwd"].amax_history.shape == (31, 6) and meta["scaling_bwd"].scale.shape == (4,)
    assert meta["fp8_max_fwd"] == 448.0 and meta["fp8_max_bwd"] == 57344.0
    assert torch.equal(meta["scaling_fwd"].scale, torch.ones(6))
    with pytest.raises(TypeError, match="delayed scaling"):
        M.make_fp8_meta(Float8CurrentScaling())
    with pytest.raises(ValueError, match="num_gemms"):
        M.make_fp8_meta(DelayedScaling(), num_gemms=4)


def test_update_rule_by_hand():
    # Columns: a normal amax, amax 0, inf, NaN, a tiny amax whose quotient overflows.
    history = [[2.0, 0.0, math.inf, math.nan, 1e-45],
               [8.0, 0.0, 1.0, 1.0, 0.0],
               [4.0, 0.0, 1.0, 1.0, 0.0]]
    recipe = DelayedScaling(amax_history_len=3)
    meta = meta_with(history, [1.0, 5.0, 6.0, 7.0, 1.0], recipe)
    M.amax_and_scale_update(meta, 448.0, recipe)
    # max over the history: 8 -> 448/8 = 56; 0 keeps 5; inf keeps 6; a NaN entry is skipped (TE's
    # fmaxf), so max(1, 1) -> 448; 448/1e-45 overflows float32 -> FLT_MAX.
    assert meta.scale.tolist() == [56.0, 5.0, 6.0, 448.0, FLT_MAX]
    assert meta.scale_inv.tolist() == (1.0 / meta.scale).tolist()
    # Rolled one row up, row 0 (the old row 1's slot) zeroed, the old row 0 last.
    assert meta.amax_history[0].tolist() == [0.0] * 5
    assert meta.amax_history[1].tolist() == [4.0, 0.0, 1.0, 1.0, 0.0]
    want_last = torch.tensor(history[0], dtype=torch.float32)
    assert torch.equal(meta.amax_history[2].isnan(), want_last.isnan())
    assert meta.amax_history[2][:3].tolist() == [2.0, 0.0, math.inf]


def test_update_rule_most_recent_and_margin():
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent", margin=2)
    meta = meta_with([[2.0], [8.0]], [1.0], recipe)
    M.amax_and_scale_update(meta, 448.0, recipe)
    assert meta.scale.tolist() == [448.0 / 2.0 / 4.0]  # row 0 only, 2^-margin


def test_most_recent_amax_of_zero_inf_nan_keeps_the_scale():
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    meta = meta_with([[0.0, math.inf, math.nan, 2.0], [9.0, 9.0, 9.0, 9.0]], [3.0, 4.0, 5.0, 1.0], recipe)
    M.amax_and_scale_update(meta, 448.0, recipe)
    assert meta.scale.tolist() == [3.0, 4.0, 5.0, 224.0]
    all_nan = meta_with([[math.nan], [math.nan]], [6.0], DelayedScaling(amax_history_len=2))
    M.amax_and_scale_update(all_nan, 448.0, DelayedScaling(amax_history_len=2))
    assert all_nan.scale.tolist() == [6.0]


def test_update_rule_history_of_one():
    recipe = DelayedScaling(amax_history_len=1)
    meta = meta_with([[3.5]], [1.0], recipe)
    M.amax_and_scale_update(meta, 57344.0, recipe)
    assert meta.scale.tolist() == [57344.0 / 3.5] and meta.amax_history.tolist() == [[0.0]]


def test_update_rule_callables():
    seen = {}

    def amax_algo(history):
        seen["history"] = history.clone()
        return history.mean(dim=0)

    def sf_algo(amax, scale, fp8_max, recipe):
        seen["args"] = (amax.clone(), scale.clone(), fp8_max, recipe)
        return scale * 0 + fp8_max / (2 * amax)

    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=amax_algo, scaling_factor_compute_algo=sf_algo)
    meta = meta_with([[2.0], [6.0]], [1.0], recipe)
    M.amax_and_scale_update(meta, 448.0, recipe)
    assert seen["history"].tolist() == [[2.0], [6.0]]
    assert seen["args"][0].tolist() == [4.0] and seen["args"][2] == 448.0 and seen["args"][3] is recipe
    assert meta.scale.tolist() == [56.0]


def test_update_keeps_storage_for_quantizer_views():
    recipe = DelayedScaling(amax_history_len=4)
    meta = meta_with([[1.0]] * 4, [1.0], recipe)
    scale_view, amax_view = meta.scale[0:1], meta.amax_history[0][0:1]
    M.amax_and_scale_update(meta, 448.0, recipe)
    assert scale_view.data_ptr() == meta.scale.data_ptr() and scale_view.item() == 448.0
    assert amax_view.data_ptr() == meta.amax_history.data_ptr() and amax_view.item() == 0.0


# ---------------------------------------------------------------- autocast


def test_autocast_nesting_restores_state():
    outer, inner = DelayedScaling(amax_history_len=8), Float8CurrentScaling()
    assert not G.is_fp8_enabled() and G.get_autocast_depth() == 0
    with te.fp8_autocast(enabled=True, fp8_recipe=outer):
        assert G.is_fp8_enabled() and G.get_fp8_recipe() is outer and G.get_autocast_depth() == 1
        with te.autocast(enabled=False, recipe=inner):
            assert not G.is_fp8_enabled() and G.get_fp8_recipe() is inner and G.get_autocast_depth() == 2
            with te.autocast(enabled=True, calibrating=True, recipe=inner):
                assert G.is_fp8_calibration() and G.get_autocast_depth() == 3
            assert not G.is_fp8_calibration()
        assert G.is_fp8_enabled() and G.get_fp8_recipe() is outer
    assert not G.is_fp8_enabled() and G.get_autocast_depth() == 0


def test_first_module_is_the_outermost_autocasts_first_asker():
    with te.autocast():
        assert G.is_first_fp8_module() is True
        assert G.is_first_fp8_module() is False
        with te.autocast():  # a nested autocast does not make a new first module
            assert G.is_first_fp8_module() is False
    with te.autocast():
        assert G.is_first_fp8_module() is True


def test_autocast_as_a_decorator_and_entered_once():
    """As contextlib's context managers: a decorated function enters a fresh
    autocast per call (recursion nests), and one autocast object is entered
    once."""
    recipe = DelayedScaling(amax_history_len=2)

    @te.fp8_autocast(enabled=True, fp8_recipe=recipe)
    def depth(n):
        assert G.is_fp8_enabled() and G.get_fp8_recipe() is recipe
        return G.get_autocast_depth() if n == 0 else depth(n - 1)
    assert depth(2) == 3 and depth(0) == 1
    assert G.get_autocast_depth() == 0 and not G.is_fp8_enabled()
    block = te.autocast(enabled=True, recipe=recipe)
    with block:
        pass
    with pytest.raises(RuntimeError, match="entered once"):
        with block:
            pass
    assert G.get_autocast_depth() == 0


def test_exception_inside_autocast_restores_state():
    with pytest.raises(KeyError):
        with te.autocast(enabled=True):
            raise KeyError("x")
    assert not G.is_fp8_enabled() and G.get_autocast_depth() == 0


def step(meta, x, recipe, **autocast_kw):
    """One 'module call': register, quantize the input with role 0's quantizer."""
    with te.autocast(enabled=True, recipe=recipe, **autocast_kw):
        G.add_fp8_tensors_to_global_buffer(meta)
        fwd = meta["scaling_fwd"]
        q = Float8Quantizer(fwd.scale[0:1], fwd.amax_history[0][0:1], torch.float8_e4m3fn)
        return q(x)


def test_scales_update_at_the_outermost_exit():
    recipe = DelayedScaling(amax_history_len=3)
    meta = M.make_fp8_meta(recipe)
    fwd = meta["scaling_fwd"]
    x1 = torch.full((16, 16), 2.0)
    with te.autocast(enabled=True, recipe=recipe):
        y = step(meta, x1, recipe)  # a nested autocast: no update at its exit
        assert fwd.scale[0].item() == 1.0 and fwd.amax_history[0, 0].item() == 2.0
    assert y._scale_inv.item() == 1.0  # cast with the old scale
    assert fwd.scale[0].item() == 224.0 and fwd.amax_history[:, 0].tolist() == [0.0, 0.0, 2.0]
    y = step(meta, torch.full((16, 16), 7.0), recipe)  # the next step casts with 224
    assert y._scale_inv.item() == torch.tensor(1.0 / 224.0).item()
    assert y.dequantize().max().item() == 2.0  # 7 * 224 saturates at 448: what delayed scaling risks
    assert fwd.scale[0].item() == 64.0  # 448 / max(2, 7)
    step(meta, torch.full((16, 16), 1.0), recipe)
    step(meta, torch.full((16, 16), 1.0), recipe)
    assert fwd.scale[0].item() == 64.0  # 7 still in the window of 3
    step(meta, torch.full((16, 16), 1.0), recipe)
    assert fwd.scale[0].item() == 448.0  # 7 left the window
    assert meta["scaling_bwd"].scale.tolist() == [1.0, 1.0]  # backward: updated by the first module's backward
    G.reduce_and_update_fp8_tensors(forward=False)
    assert meta["scaling_bwd"].scale.tolist() == [1.0, 1.0]  # amax 0: kept


def test_autocast_keys_tell_recipes_apart():
    key = G.get_unique_autocast_key
    assert key(DelayedScaling(), None) == key(DelayedScaling(), None)
    assert key(DelayedScaling(), None) != key(DelayedScaling(reduce_amax=False), None)
    assert key(DelayedScaling(), None) != key(DelayedScaling(amax_compute_algo="most_recent"), None)
    assert key(DelayedScaling(), None) != key(Float8CurrentScaling(), None)


def test_module_called_twice_maxes_into_one_row():
    recipe = DelayedScaling(amax_history_len=2)
    meta = M.make_fp8_meta(recipe)
    with te.autocast(enabled=True, recipe=recipe):
        for v in (3.0, 5.0):
            G.add_fp8_tensors_to_global_buffer(meta)
            fwd = meta["scaling_fwd"]
            Float8Quantizer(fwd.scale[0:1], fwd.amax_history[0][0:1], torch.float8_e4m3fn)(torch.full((4, 16), v))
    assert len(G.global_amax_buffer) == 2  # registered once: one forward and one backward buffer
    assert meta["scaling_fwd"].scale[0].item() == torch.tensor(448.0 / 5.0).item()
    assert len(G.global_amax_buffer["forward_" + G.get_unique_autocast_key(recipe, None)]) == 1


def _observe(meta, v):
    fwd = meta["scaling_fwd"]
    Float8Quantizer(fwd.scale[0:1], fwd.amax_history[0][0:1], torch.float8_e4m3fn)(torch.full((4, 16), v))


@pytest.mark.parametrize("algo", ["max", "most_recent", lambda h: h.max(dim=0).values])
def test_a_meta_registered_in_a_later_step_is_updated_too(algo):
    """The step's update is prepared once per buffer (checked arguments,
    engine pointers) and made again when a registration appends to it: a
    module that joins in a later step has its scale updated from then on,
    and the update equals the rule applied meta by meta."""
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    first, later, ref = (M.make_fp8_meta(recipe) for _ in range(3))
    with te.autocast(enabled=True, recipe=recipe):
        G.add_fp8_tensors_to_global_buffer(first)
        _observe(first, 3.0)
    assert first["scaling_fwd"].scale[0].item() == torch.tensor(448.0 / 3.0).item()
    for v in (5.0, 2.0):
        with te.autocast(enabled=True, recipe=recipe):
            G.add_fp8_tensors_to_global_buffer(first)
            G.add_fp8_tensors_to_global_buffer(later)
            _observe(first, v)
            _observe(later, v)
        _observe(ref, v)
        M.amax_and_scale_update(ref["scaling_fwd"], recipe.fp8_format.value.max_fwd, recipe)
        for name in ("scale", "scale_inv", "amax_history"):
            assert torch.equal(getattr(later["scaling_fwd"], name), getattr(ref["scaling_fwd"], name)), name
    newest_or_max = 2.0 if algo == "most_recent" else 5.0  # the history holds [2, 5, 0]
    assert later["scaling_fwd"].scale[0].item() == torch.tensor(448.0 / newest_or_max).item()


def test_the_prepared_update_follows_registrations_under_another_recipe():
    """Each direction's update of all buffers is prepared once, and made
    again after any registration: a meta registered under another recipe
    (a buffer of its own) after the first update is updated, forward and
    backward, and the first meta still is."""
    r1, r2 = DelayedScaling(amax_history_len=2), DelayedScaling(amax_history_len=2, margin=1)
    a, b = M.make_fp8_meta(r1), M.make_fp8_meta(r2)
    with te.autocast(enabled=True, recipe=r1):
        G.add_fp8_tensors_to_global_buffer(a)
        _observe(a, 4.0)
    G.reduce_and_update_fp8_tensors(forward=False)
    assert a["scaling_fwd"].scale[0].item() == 112.0  # 448 / 4
    with te.autocast(enabled=True, recipe=r2):
        G.add_fp8_tensors_to_global_buffer(b)
        _observe(a, 8.0)
        _observe(b, 8.0)
        b["scaling_bwd"].amax_history[0, 0] = 2.0 ** 10
    G.reduce_and_update_fp8_tensors(forward=False)
    assert a["scaling_fwd"].scale[0].item() == 56.0  # 448 / 8
    assert b["scaling_fwd"].scale[0].item() == 28.0  # 448 / 8 / 2
    assert b["scaling_bwd"].scale[0].item() == 57344.0 / 2.0 ** 11


def test_reset_drops_the_prepared_update():
    """After reset() the metas registered before are no longer updated
    (their prepared update is dropped with the buffers)."""
    recipe = DelayedScaling(amax_history_len=2)
    meta = M.make_fp8_meta(recipe)
    with te.autocast(enabled=True, recipe=recipe):
        G.add_fp8_tensors_to_global_buffer(meta)
        _observe(meta, 4.0)
    assert meta["scaling_fwd"].scale[0].item() == 112.0
    G.reset()
    with te.autocast(enabled=True, recipe=recipe):
        _observe(meta, 8.0)
    assert meta["scaling_fwd"].scale[0].item() == 112.0
    assert meta["scaling_fwd"].amax_history[0, 0].item() == 8.0


@pytest.mark.parametrize("how", ["no_grad", "graph", "disabled"])
def test_no_update_without_grad_in_graphs_or_disabled(how):
    recipe = DelayedScaling(amax_history_len=2)
    meta = M.make_fp8_meta(recipe)
    x = torch.full((4, 16), 4.0)
    if how == "no_grad":
        with torch.no_grad():
            step(meta, x, recipe)
    elif how == "graph":
        step(meta, x, recipe, _graph=True)
    else:
        with te.autocast(enabled=False, recipe=recipe):
            G.add_fp8_tensors_to_global_buffer(meta)
            meta["scaling_fwd"].amax_history[0, 0] = 4.0
    assert meta["scaling_fwd"].scale[0].item() == 1.0
    assert meta["scaling_fwd"].amax_history[0, 0].item() == 4.0  # kept for the next update
    step(meta, torch.full((4, 16), 1.0), recipe)
    assert meta["scaling_fwd"].scale[0].item() == 112.0  # 448 / 4


def test_fp8_on_an_old_gpu_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "A100")
    ok, reason = G.is_fp8_available()
    assert ok is False and "compute capability 8.9 or higher required" in reason and "8.0" in reason
    assert te.quantization.is_fp8_available() is False
    with pytest.raises(RuntimeError, match="compute capability 8.9 or higher"):
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            pass
    assert G.get_autocast_depth() == 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert G.is_fp8_available() == (True, "")
    assert isinstance(te.quantization.get_default_fp8_recipe(), DelayedScaling)


def test_fp8_on_the_cpu_is_emulated(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert G.is_fp8_available() == (True, "")  # TE's answer when available: an empty reason


def test_autocast_key_follows_a_changed_recipe():
    """The key is remembered per recipe object, and made again when one of
    its fields changed (a nested QParams too): equal recipes share a key,
    a changed one does not keep its old one."""
    from transformer_engine_c.quantization import FP8GlobalStateManager as G
    from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling
    d = DelayedScaling()
    first = G.get_unique_autocast_key(d)
    assert G.get_unique_autocast_key(d) == first == G.get_unique_autocast_key(DelayedScaling())
    d.margin = 2
    assert G.get_unique_autocast_key(d) != first
    assert G.get_unique_autocast_key(d) == G.get_unique_autocast_key(DelayedScaling(margin=2))
    c = Float8CurrentScaling()
    before = G.get_unique_autocast_key(c)
    c.fp8_quant_fwd_inp.power_2_scale = not c.fp8_quant_fwd_inp.power_2_scale
    assert G.get_unique_autocast_key(c) != before


@pytest.mark.parametrize("modules", [1, 6])
def test_each_direction_updates_every_module_in_one_engine_call(monkeypatch, modules):
    """However many modules took part, the autocast's exit updates the
    forward roles and the end of backward the backward roles of all of them
    in one engine call each (fp8_delayed_updates, one record per module),
    and every module's scales do change."""
    from transformer_engine_c import _C

    G.reset()
    calls = []
    real = _C.fp8_delayed_updates
    monkeypatch.setattr(_C, "fp8_delayed_updates", lambda dev, rec, stream: calls.append(len(rec) // 64) or
                        real(dev, rec, stream))
    recipe = DelayedScaling(amax_history_len=2)
    layers = [te.Linear(32, 32) for _ in range(modules)]
    x = torch.randn(16, 32, device=layers[0].weight.device, requires_grad=True)
    for step_ in range(2):
        calls.clear()
        with te.autocast(enabled=True, recipe=recipe):
            y = x
            for m in layers:
                y = m(y)
        assert calls == [modules]  # the forward update, at the exit
        y.sum().backward()
        assert calls == [modules, modules]  # and the backward one
    for m in layers:
        assert m.fp8_meta["scaling_fwd"].scale[0].item() != 1.0
        assert m.fp8_meta["scaling_bwd"].scale[0].item() != 1.0
    G.reset()
