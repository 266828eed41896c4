"""`_extra_state` holding the FP8 recipe and fp8_meta as TransformerEngine
2.x writes it (module/_extra_state.py): round trips through state_dict and
torch.save for the three layers, TE's module names, TE 1.x's forms, the
history-length rule, and the restricted unpickler refusing everything else
without running it.

Run: PYTHONPATH=. python3 -m pytest -q tests/test_fp8_extra_state.py"""
import dataclasses
import enum
import io
import os
import pickle
import sys
import types
import typing

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c._fp8_meta import make_fp8_meta
from transformer_engine_c.module import _extra_state as X
from transformer_engine_c.quantization import FP8GlobalStateManager as G
from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling, Format, MMParams, QParams

LAYERS = {
    "Linear": lambda device: te.Linear(16, 32, device=device),
    "LayerNormLinear": lambda device: te.LayerNormLinear(16, 32, device=device),
    "LayerNormMLP": lambda device: te.LayerNormMLP(16, 32, device=device),
}
NUM_GEMMS = {"Linear": 1, "LayerNormLinear": 1, "LayerNormMLP": 2}
OUT_FEATURES = {"Linear": 32, "LayerNormLinear": 32, "LayerNormMLP": 16}


def no_fp8_state(m):
    """The module holds no FP8 state: TE's fp8_meta from construction (the
    norms, as TE's, have none)."""
    meta = getattr(m, "fp8_meta", None)
    if isinstance(m, (te.LayerNorm, te.RMSNorm)):
        return meta is None
    return meta == {"fp8_checkpoint": False, "fp8_group": None}


def as_tensor(b):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def fabricate(layer, recipe, device, seed=0):
    """A trained-looking delayed-scaling fp8_meta on `layer` (random scales
    and histories, scale_inv = 1 / scale)."""
    g = torch.Generator().manual_seed(seed)
    layer.fp8_meta = meta = make_fp8_meta(recipe, type(layer)._fp8_num_gemms, device)
    for m in (meta["scaling_fwd"], meta["scaling_bwd"]):
        m.scale.copy_(torch.rand(m.scale.shape, generator=g) * 8 + 0.25)
        torch.reciprocal(m.scale, out=m.scale_inv)
        m.amax_history.copy_(torch.rand(m.amax_history.shape, generator=g) * 100)
    return meta


def through_torch_save(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same_meta(a, b):
    assert a["recipe"] == b["recipe"] and type(a["recipe"]) is type(b["recipe"])
    for key in ("scaling_fwd", "scaling_bwd"):
        for f in ("scale", "scale_inv", "amax_history"):
            x, y = getattr(a[key], f), getattr(b[key], f)
            assert x.device == y.device and torch.equal(x, y), (key, f)
    assert a["num_gemms"] == b["num_gemms"]
    assert a["fp8_max_fwd"] == b["fp8_max_fwd"] and a["fp8_max_bwd"] == b["fp8_max_bwd"]


# ------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_declare_their_gemms(name):
    assert type(LAYERS[name]("cpu"))._fp8_num_gemms == NUM_GEMMS[name]


@pytest.mark.parametrize("name", list(LAYERS))
def test_delayed_scaling_round_trip(name, device):
    src = LAYERS[name](device)
    recipe = DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=7, amax_compute_algo="most_recent",
                            reduce_amax=False)
    fabricate(src, recipe, device)
    sd = src.state_dict()
    extra = sd["_extra_state"]
    assert extra.dtype == torch.uint8 and extra.device.type == "cpu" and extra.dim() == 1 and extra.numel() > 0
    # TE's layout, read back by plain pickle
    state = pickle.loads(X._tensor_bytes(extra, name))
    assert set(state) == {"recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd",
                          "extra_fp8_variables"}
    n = NUM_GEMMS[name]
    assert state["scale_fwd"].shape == (3 * n,) and state["amax_history_bwd"].shape == (7, 2 * n)
    assert all(state[k].device.type == "cpu" and state[k].dtype == torch.float32
               for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"))
    assert state["extra_fp8_variables"]["fp8_checkpoint"] is True
    assert state["extra_fp8_variables"]["num_gemms"] == n
    # into a fresh layer, strict, through torch.save / torch.load(weights_only=True)
    dst = LAYERS[name](device)
    assert no_fp8_state(dst)
    dst.load_state_dict(through_torch_save(sd), strict=True)
    assert_same_meta(src.fp8_meta, dst.fp8_meta)
    # and saved again, the same state
    again = pickle.loads(X._tensor_bytes(dst.state_dict()["_extra_state"], name))
    assert again["recipe"] == state["recipe"] and again["extra_fp8_variables"] == state["extra_fp8_variables"]
    assert all(torch.equal(again[k], state[k]) for k in ("scale_fwd", "amax_history_fwd", "scale_bwd",
                                                         "amax_history_bwd"))


@pytest.mark.parametrize("name", list(LAYERS))
def test_current_scaling_keeps_the_recipe(name):
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3, fp8_quant_fwd_inp=QParams(True, 1e-3),
                                  fp8_gemm_fprop=MMParams(True))
    src = LAYERS[name]("cpu")
    src.fp8_meta = {"recipe": recipe, "fp8_group": None}
    sd = src.state_dict()
    state = pickle.loads(X._tensor_bytes(sd["_extra_state"], name))
    assert set(state) == {"recipe", "extra_fp8_variables"} and state["recipe"] == recipe
    dst = LAYERS[name]("cpu")
    fabricate(dst, DelayedScaling(amax_history_len=3), "cpu")  # a delayed meta is replaced by the recipe's
    dst.load_state_dict(sd, strict=True)
    assert dst.fp8_meta["recipe"] == recipe and "scaling_fwd" not in dst.fp8_meta


@pytest.mark.parametrize("name", list(LAYERS))
def test_without_fp8_state_strict_loading(name):
    src, dst = LAYERS[name]("cpu"), LAYERS[name]("cpu")
    sd = src.state_dict()
    assert sd["_extra_state"].numel() == 0
    dst.load_state_dict(through_torch_save(sd), strict=True)
    assert no_fp8_state(dst)
    # a layer with FP8 state keeps it when the checkpoint has none (TE: nothing to load)
    meta = fabricate(dst, DelayedScaling(amax_history_len=2), "cpu")
    dst.load_state_dict(sd, strict=True)
    assert dst.fp8_meta is meta


def test_loading_into_a_fitting_meta_copies_in_place():
    """A layer whose fp8_meta already has the checkpoint's layout keeps its
    tensors (quantizers and the autocast's global buffers hold views of
    them) and its registration."""
    recipe = DelayedScaling(amax_history_len=5)
    src, dst = te.LayerNormMLP(16, 32, device="cpu"), te.LayerNormMLP(16, 32, device="cpu")
    fabricate(src, recipe, "cpu", seed=1)
    meta = fabricate(dst, DelayedScaling(amax_history_len=5, margin=2), "cpu", seed=2)
    meta["buffer_index_and_autocast_key"] = {"forward_k": 0}
    tensors = [getattr(meta[k], f) for k in ("scaling_fwd", "scaling_bwd") for f in ("scale", "scale_inv",
                                                                                     "amax_history")]
    dst.load_state_dict(src.state_dict(), strict=True)
    assert dst.fp8_meta is meta and meta["buffer_index_and_autocast_key"] == {"forward_k": 0}
    assert all(a is b for a, b in zip(tensors, [getattr(meta[k], f) for k in ("scaling_fwd", "scaling_bwd")
                                                for f in ("scale", "scale_inv", "amax_history")]))
    assert_same_meta(src.fp8_meta, meta)


def test_other_layout_gets_a_fresh_meta():
    """A history length or layer kind that does not fit: a fresh fp8_meta
    on the parameters' device; a Linear's state into LayerNormMLP is an
    error naming the shapes."""
    src = te.Linear(16, 32, device="cpu")
    fabricate(src, DelayedScaling(amax_history_len=9), "cpu")
    dst = te.Linear(16, 32, device="cpu")
    old = fabricate(dst, DelayedScaling(amax_history_len=4), "cpu")
    dst.load_state_dict(src.state_dict(), strict=True)
    assert dst.fp8_meta is not old
    assert_same_meta(src.fp8_meta, dst.fp8_meta)
    with pytest.raises(ValueError, match=r"scale_fwd has shape \[3\], expected \[6\]"):
        te.LayerNormMLP(16, 32, device="cpu").set_extra_state(src.get_extra_state())


@pytest.fixture
def fresh_fp8_state():
    G.reset()
    yield
    G.reset()


def fp8_step(layer, opt, x, dy, recipe):
    with te.autocast(enabled=True, recipe=recipe):
        y = layer(x)
    y.backward(dy)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return y.detach()


def snapshot(layer):
    meta = layer.fp8_meta
    return ([p.detach().clone() for p in layer.parameters()],
            {k: meta[k].__class__.of(meta[k].scale.clone(), meta[k].scale_inv.clone(), meta[k].amax_history.clone())
             for k in ("scaling_fwd", "scaling_bwd")},
            {k: meta[k] for k in ("recipe", "num_gemms", "fp8_max_fwd", "fp8_max_bwd")})


@pytest.mark.parametrize("name", list(LAYERS))
def test_fp8_training_resumes_bit_identically(name, device, fresh_fp8_state):
    """A few FP8 steps, a checkpoint (torch.save of the state_dict), a fresh
    layer loaded from it strictly: the next step's output, the weights after
    it and the updated scaling state are bit-identical to those of the
    layer that kept training. (Each layer runs alone: every autocast exit
    updates all the metas registered under its recipe.)"""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    a = LAYERS[name](device)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(32, 16, generator=g) * (i + 1)).to(device),
             (torch.randn(32, OUT_FEATURES[name], generator=g) * 0.01 * (i + 1)).to(device)) for i in range(5)]
    for x, dy in data[:4]:
        fp8_step(a, opt, x, dy, recipe)
    assert a.fp8_meta["scaling_fwd"].amax_history.any()  # trained: the history holds amaxes
    ckpt = through_torch_save(a.state_dict())
    ya = fp8_step(a, opt, *data[4], recipe)
    params_a, scaling_a, rest_a = snapshot(a)

    G.reset()
    torch.manual_seed(7)
    b = LAYERS[name](device)
    b.load_state_dict(ckpt, strict=True)
    yb = fp8_step(b, torch.optim.SGD(b.parameters(), lr=0.1), *data[4], recipe)
    params_b, scaling_b, rest_b = snapshot(b)
    assert torch.equal(ya, yb)
    assert all(torch.equal(p, q) for p, q in zip(params_a, params_b))
    assert_same_meta({**scaling_a, **rest_a}, {**scaling_b, **rest_b})

    # without the FP8 state the resumed step differs (the checks above are not vacuous)
    G.reset()
    c = LAYERS[name](device)
    c.load_state_dict({**ckpt, "_extra_state": torch.empty(0, dtype=torch.uint8)}, strict=True)
    yc = fp8_step(c, torch.optim.SGD(c.parameters(), lr=0.1), *data[4], recipe)
    assert not torch.equal(ya, yc)


# -------------------------------------------- history length, older forms


def scaling_state(n_gemms, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"scale_fwd": torch.rand(3 * n_gemms, generator=g) + 1,
            "amax_history_fwd": torch.rand(rows, 3 * n_gemms, generator=g),
            "scale_bwd": torch.rand(2 * n_gemms, generator=g) + 1,
            "amax_history_bwd": torch.rand(rows, 2 * n_gemms, generator=g)}


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_history_fitted_to_the_recipe(rows):
    """TE's adjust_amax_history_length: a longer history keeps its first
    rows, a shorter one gets zero rows appended."""
    state = scaling_state(1, rows)
    state["recipe"] = DelayedScaling(amax_history_len=4)
    state["extra_fp8_variables"] = {}
    layer = te.Linear(16, 16, device="cpu")
    layer.set_extra_state(as_tensor(pickle.dumps(state)))
    for d in ("fwd", "bwd"):
        h, saved = layer.fp8_meta[f"scaling_{d}"].amax_history, state[f"amax_history_{d}"]
        assert h.shape[0] == 4
        k = min(rows, 4)
        assert torch.equal(h[:k], saved[:k]) and not h[k:].any()
        m = layer.fp8_meta[f"scaling_{d}"]
        assert torch.equal(m.scale, state[f"scale_{d}"]) and torch.equal(m.scale_inv, 1 / state[f"scale_{d}"])


def te1_state(rows):
    state = scaling_state(1, rows, seed=3)
    state["scale_inv_fwd"] = 1 / state["scale_fwd"]
    state["scale_inv_bwd"] = 1 / state["scale_bwd"]
    state["extra_fp8_variables"] = {"fp8_checkpoint": True, "num_gemms": 1, "first_module": False,
                                    "fp8_max_fwd": 448.0, "fp8_max_bwd": 57344.0}
    return state


def test_te1_tensor_form_without_a_recipe():
    state = te1_state(6)
    layer = te.Linear(16, 16, device="cpu")
    layer.load_state_dict({**layer.state_dict(), "_extra_state": as_tensor(pickle.dumps(state))}, strict=True)
    assert layer.fp8_meta["recipe"] == DelayedScaling(amax_history_len=6)
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history, state["amax_history_fwd"])
    assert layer.fp8_meta["first_module"] is False  # TE's other plain entries are kept


def test_te1_bytesio_form():
    state = te1_state(3)
    buf = io.BytesIO()
    torch.save(state, buf)
    layer = te.Linear(16, 16, device="cpu")
    sd = layer.state_dict()
    sd["_extra_state"] = buf
    layer.load_state_dict(sd, strict=True)
    assert torch.equal(layer.fp8_meta["scaling_bwd"].scale, state["scale_bwd"])
    assert layer.fp8_meta["recipe"].amax_history_len == 3
    # with this package's recipe in it, too
    state = {**scaling_state(1, 5), "recipe": DelayedScaling(amax_history_len=5, margin=3),
             "extra_fp8_variables": {}}
    buf = io.BytesIO()
    torch.save(state, buf)
    layer.set_extra_state(buf)
    assert layer.fp8_meta["recipe"].margin == 3


def test_empty_and_stateless_payloads_load_nothing():
    layer = te.Linear(16, 16, device="cpu")
    for payload in (None, torch.empty(0, dtype=torch.uint8), as_tensor(pickle.dumps(None)),
                    as_tensor(pickle.dumps({}))):
        layer.set_extra_state(payload)
        assert no_fp8_state(layer)


def test_bad_payloads():
    layer = te.Linear(16, 16, device="cpu")
    with pytest.raises(TypeError, match="_extra_state must be a uint8 tensor"):
        layer.set_extra_state({"not": "a tensor"})
    with pytest.raises(TypeError, match="got torch.float32"):
        layer.set_extra_state(torch.ones(3))
    with pytest.raises(ValueError, match="holds a list"):
        layer.set_extra_state(as_tensor(pickle.dumps([1, 2])))
    with pytest.raises(ValueError, match="not a recipe"):
        layer.set_extra_state(as_tensor(pickle.dumps({"recipe": None})))
    with pytest.raises(ValueError, match="no tensor 'scale_bwd'"):
        state = {**scaling_state(1, 2), "recipe": DelayedScaling(amax_history_len=2)}
        del state["scale_bwd"]
        layer.set_extra_state(as_tensor(pickle.dumps(state)))
    with pytest.raises(ValueError, match="not usable here"):  # a recipe its checks refuse
        r = DelayedScaling()
        r.__dict__["amax_history_len"] = 0
        layer.set_extra_state(as_tensor(pickle.dumps({**scaling_state(1, 2), "recipe": r})))
    assert no_fp8_state(layer)


@pytest.mark.parametrize("make", [lambda: te.LayerNorm(16, device="cpu"), lambda: te.RMSNorm(16, device="cpu"),
                                  lambda: te.DotProductAttention(2, 8),
                                  lambda: te.GroupedLinear(2, 16, 16, device="cpu")])
def test_modules_without_fp8_state_ignore_it_with_a_warning(make):
    m = make()
    state = {**scaling_state(1, 4), "recipe": DelayedScaling(amax_history_len=4), "extra_fp8_variables": {}}
    sd = {**m.state_dict(), "_extra_state": as_tensor(pickle.dumps(state))}
    with pytest.warns(UserWarning, match="FP8 metadata .*DelayedScaling.*ignored"):
        m.load_state_dict(sd, strict=True)
    assert no_fp8_state(m) and m.state_dict()["_extra_state"].numel() == 0
    with pytest.raises(pickle.UnpicklingError, match="posix.system|nt.system"):  # still checked
        m.set_extra_state(as_tensor(pickle.dumps(Evil("true"))))


# ------------------------------------------------- TE's module names


@pytest.fixture
def te_recipe(monkeypatch):
    """A stand-in for TransformerEngine's transformer_engine.common.recipe
    (TE 2.9's classes and fields, frozen QParams / MMParams with TE's newer
    fields), so that plain pickle names its classes as TE's do."""
    name = "transformer_engine.common.recipe"
    mod = types.ModuleType(name)

    class _FormatHelper(typing.NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E2M1 = _FormatHelper(max_fwd=6.0, max_bwd=6.0)
        E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
        E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
        HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, max_bwd=E5M2.max_bwd)

    @dataclasses.dataclass(frozen=True)
    class MMParams:
        use_split_accumulator: bool = True

    @dataclasses.dataclass(frozen=True)
    class QParams:
        power_2_scale: bool = False
        amax_epsilon: float = 0.0
        random_hadamard_transform: bool = False
        stochastic_rounding: bool = False

    class Recipe:
        pass

    @dataclasses.dataclass()
    class DelayedScaling(Recipe):
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: typing.Any = "max"
        scaling_factor_compute_algo: typing.Any = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False

    @dataclasses.dataclass()
    class Float8CurrentScaling(Recipe):
        use_power_2_scales: bool = False
        fp8_format: Format = Format.HYBRID
        fp8_quant_fwd_inp: QParams = QParams()
        fp8_quant_fwd_weight: QParams = QParams()
        fp8_quant_bwd_grad: QParams = QParams()
        fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
        fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
        fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
        fp8_dpa: bool = False
        fp8_mha: bool = False

    for cls in (_FormatHelper, Format, MMParams, QParams, Recipe, DelayedScaling, Float8CurrentScaling):
        cls.__module__, cls.__qualname__ = name, cls.__name__
        setattr(mod, cls.__name__, cls)
    pkg, common = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
    pkg.common, common.recipe = common, mod
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_te_named_delayed_scaling_loads(te_recipe):
    """A pickle naming transformer_engine.common.recipe.DelayedScaling (as
    TE writes it) loads as this package's DelayedScaling."""
    state = {"recipe": te_recipe.DelayedScaling(margin=2, fp8_format=te_recipe.Format.E4M3, amax_history_len=4),
             **scaling_state(2, 4), "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 2,
                                                           "fp8_max_fwd": 448.0, "fp8_max_bwd": 448.0}}
    data = pickle.dumps(state)
    assert b"transformer_engine.common.recipe" in data and b"DelayedScaling" in data
    layer = te.LayerNormMLP(16, 32, device="cpu")
    layer.load_state_dict({**layer.state_dict(), "_extra_state": as_tensor(data)}, strict=True)
    r = layer.fp8_meta["recipe"]
    assert type(r) is DelayedScaling and r == DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=4)
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history, state["amax_history_fwd"])


def test_te_named_current_scaling_loads(te_recipe):
    r = te_recipe.Float8CurrentScaling(fp8_quant_fwd_weight=te_recipe.QParams(power_2_scale=True,
                                                                             random_hadamard_transform=True))
    layer = te.Linear(16, 16, device="cpu")
    layer.set_extra_state(as_tensor(pickle.dumps({"recipe": r, "extra_fp8_variables": {"fp8_checkpoint": True}})))
    got = layer.fp8_meta["recipe"]
    assert got == Float8CurrentScaling(fp8_quant_fwd_weight=QParams(power_2_scale=True))
    assert not hasattr(got, "use_power_2_scales") and not hasattr(got.fp8_quant_fwd_weight, "stochastic_rounding")


def test_te_format_unknown_here_is_an_error(te_recipe):
    r = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.E2M1)
    with pytest.raises(ValueError, match="not a valid Format"):
        te.Linear(16, 16, device="cpu").set_extra_state(as_tensor(pickle.dumps({"recipe": r, **scaling_state(1, 2)})))


# ------------------------------------------------- what is refused


class Evil:
    """Runs a shell command when unpickled by plain pickle."""

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class EvilStorage:
    """A tensor storage whose bytes are a full torch.save of Evil: what
    torch.storage._load_from_bytes would run."""

    def __init__(self, cmd):
        buf = io.BytesIO()
        torch.save(Evil(cmd), buf, _use_new_zipfile_serialization=False)
        self.blob = buf.getvalue()

    def __reduce__(self):
        import torch.storage
        return torch.storage._load_from_bytes, (self.blob,)


def module_level_algo(history):
    return history.max(dim=0).values


@pytest.mark.parametrize("payload, refused", [
    (lambda cmd: {"recipe": Evil(cmd)}, r"(posix|nt)\.system"),
    (lambda cmd: {"recipe": DelayedScaling(), "scale_fwd": Evil(cmd)}, r"(posix|nt)\.system"),
    (lambda cmd: {"extra_fp8_variables": {"x": Evil(cmd)}}, r"(posix|nt)\.system"),
    (lambda cmd: {"recipe": DelayedScaling(amax_compute_algo=module_level_algo)}, "module_level_algo"),
    (lambda cmd: {"recipe": DelayedScaling(), "scale_fwd": EvilStorage(cmd)}, "refusing a tensor storage .*"
                                                                              "(GLOBAL|global).*system"),
    (lambda cmd: {"f": eval}, "builtins.eval"),
    (lambda cmd: {"f": torch.load}, "torch.serialization.load"),
])
def test_malicious_pickle_is_refused_and_not_run(payload, refused, tmp_path):
    marker = tmp_path / "ran"
    cmd = f"touch {marker}"
    data = pickle.dumps(payload(cmd))
    layer = te.Linear(16, 16, device="cpu")
    sd = {**layer.state_dict(), "_extra_state": as_tensor(data)}
    with pytest.raises(pickle.UnpicklingError, match=refused):
        layer.load_state_dict(sd, strict=True)
    assert not marker.exists()
    assert no_fp8_state(layer)
    # the refusal names the global for the format's globals too
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        X.loads(data)
    assert not marker.exists()


def test_unsafe_pickle_opt_in(monkeypatch):
    """TE's NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1: what the restricted
    unpickler refuses is loaded by the full unpickler (a trusted checkpoint;
    the refusal names the variable). The state is then checked as always."""
    import fractions
    from transformer_engine_c._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV
    assert UNSAFE_PICKLE_EXTRA_STATE_ENV == "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
    state = {**scaling_state(1, 4), "recipe": DelayedScaling(amax_history_len=4),
             "extra_fp8_variables": {"note": fractions.Fraction(1, 3), "kept": 5}}
    layer = te.Linear(16, 16, device="cpu")
    sd = {**layer.state_dict(), "_extra_state": as_tensor(pickle.dumps(state))}
    monkeypatch.delenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    with pytest.raises(pickle.UnpicklingError, match=f"fractions.Fraction.*{UNSAFE_PICKLE_EXTRA_STATE_ENV}=1"):
        layer.load_state_dict(sd, strict=True)
    monkeypatch.setenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "1")
    layer.load_state_dict(sd, strict=True)
    meta = layer.fp8_meta
    assert isinstance(meta["recipe"], DelayedScaling) and meta["recipe"].amax_history_len == 4
    assert meta["kept"] == 5 and "note" not in meta  # only plain values join the fp8_meta
    torch.testing.assert_close(meta["scaling_fwd"].scale, state["scale_fwd"])
    monkeypatch.setenv(UNSAFE_PICKLE_EXTRA_STATE_ENV, "true")  # TE's rule: only "1" opts in
    with pytest.raises(pickle.UnpicklingError):
        layer.load_state_dict(sd, strict=True)


def test_plain_pickle_of_tensors_uses_only_the_allowed_globals():
    """The tensor-rebuild globals plain pickle writes for CPU tensors
    (every protocol) are the ones the unpickler builds."""
    t = {"t": torch.ones(3), "h": torch.zeros(4, 2)[1:3]}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = X.loads(pickle.dumps(t, protocol=protocol))
        assert torch.equal(back["t"], t["t"]) and torch.equal(back["h"], t["h"])
        assert not back["t"].requires_grad


def test_loaded_tensors_are_plain():
    """requires_grad is not restored (the format's tensors are buffers)."""
    assert not X.loads(pickle.dumps(torch.ones(3, requires_grad=True))).requires_grad
