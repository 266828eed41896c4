"""TransformerEngine 2.x's `_extra_state` of a module: its FP8 recipe and,
under delayed scaling, the fp8_meta's scales and amax histories, written as
TE writes them and read back by an unpickler that builds nothing else.
Exercised by tests/test_fp8_extra_state.py; docs/decisions.md says why the
unpickler is restricted.

The format. A module without FP8 state saves an empty uint8 tensor. One
with state saves a uint8 CPU tensor holding `pickle.dumps(state)`:

  "recipe"               the recipe object (for TE a
                         `transformer_engine.common.recipe` class)
  "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"
                         float32 CPU tensors (delayed scaling only)
  "extra_fp8_variables"  the fp8_meta's entries that are plain values

Older TE checkpoints are read too: TE 1.x's, which have no "recipe" (delayed
scaling was the only one; its "scale_inv_*" entries are not needed), and
the io.BytesIO of `torch.save(state)` it wrote before the tensor form.

A module says it keeps FP8 state by the class attribute `_fp8_num_gemms`
(its fp8_meta's num_gemms); the state a checkpoint holds for a module
without one (the norms, attention) is checked and then ignored, with a
warning.
"""
import codecs
import collections
import ctypes
import dataclasses
import io
import os
import pickle
import warnings

import torch

from .. import recipe as _recipe
from .._fp8_meta import fit_history, initial_fp8_meta, make_fp8_meta, module_device

__all__ = ["get_extra_state", "set_extra_state", "loads", "UNSAFE_PICKLE_EXTRA_STATE_ENV",
           "unsafe_pickle_extra_state_enabled"]

# TE's opt-in: with this variable "1", an _extra_state the restricted
# unpickler refuses is loaded by Python's full unpickler (which runs
# whatever the pickle names: only for trusted checkpoints).
UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"

_SCALING_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
# fp8_meta entries that the module and the recipe own: never taken from a checkpoint
_OWNED_KEYS = frozenset(("recipe", "scaling_fwd", "scaling_bwd", "fp8_max_fwd", "fp8_max_bwd", "fp8_group",
                         "num_gemms", "buffer_index_and_autocast_key", "global_fp8_buffer_pos_fwd_recompute"))
_PLAIN = (bool, int, float, str, tuple, list)

_RECIPE_CLASSES = ("Format", "_FormatHelper", "QParams", "MMParams", "DelayedScaling", "Float8CurrentScaling",
                   "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling")
_RECIPE_MODULES = ("transformer_engine_c.recipe", "transformer_engine.common.recipe")


# ---------------------------------------------------------------- reading


def _weights_only_detail(e):
    """What torch's weights-only loader refused, without its advice."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))]
    return lines[0] if lines else "torch's weights-only loader refused it"


def _storage_from_bytes(b):
    """torch.storage._load_from_bytes with torch's weights-only loader (the
    original runs a full torch.load on the bytes)."""
    if not isinstance(b, (bytes, bytearray)):
        raise pickle.UnpicklingError(f"_extra_state: a tensor's storage must be bytes, got {type(b).__name__}")
    try:
        storage = torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"_extra_state: refusing a tensor storage that holds more than tensor data "
                                     f"({_weights_only_detail(e)})") from None
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"_extra_state: a tensor's storage held {type(storage).__name__}")
    return storage


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                    metadata=None):
    """torch._utils._rebuild_tensor_v2 for a plain tensor: no hooks, no
    metadata, no grad."""
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"_extra_state: a tensor must be built on a storage, got {type(storage).__name__}")
    if backward_hooks or metadata:
        raise pickle.UnpicklingError("_extra_state: a tensor with backward hooks or metadata is not part of the "
                                     "FP8 checkpoint format")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, False, collections.OrderedDict())


def _encode(text, encoding="utf-8"):
    """_codecs.encode as pickle protocols 0-2 use it for bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_extra_state: _codecs.encode is allowed only for bytes (a str, latin1)")
    return codecs.encode(text, encoding)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _encode,
}
_ALLOWED.update({(m, n): getattr(_recipe, n) for m in _RECIPE_MODULES for n in _RECIPE_CLASSES})


class _Unpickler(pickle.Unpickler):
    """Builds only the globals of the format (see _ALLOWED): this package's
    recipes, under their TE names too, and plain CPU tensors."""

    def find_class(self, module, name):
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(
                f"_extra_state: refusing to load the global {module}.{name}: a checkpoint's FP8 state holds only "
                "the recipe (transformer_engine.common.recipe classes, without callables) and CPU tensors")
        return obj

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("_extra_state: persistent ids are not part of the FP8 checkpoint format")


def unsafe_pickle_extra_state_enabled():
    """Whether UNSAFE_PICKLE_EXTRA_STATE_ENV is "1" (TE's rule)."""
    return os.environ.get(UNSAFE_PICKLE_EXTRA_STATE_ENV, "0") == "1"


_UNSAFE_ADVICE = (f"; if the checkpoint is trusted, {UNSAFE_PICKLE_EXTRA_STATE_ENV}=1 loads it with Python's full "
                  "unpickler, which runs what it names")


def loads(data):
    """The object pickled in `data` (bytes), built by the restricted
    unpickler; pickle.UnpicklingError names what it refused. With
    UNSAFE_PICKLE_EXTRA_STATE_ENV=1 what it refuses is loaded by
    pickle.loads instead."""
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if unsafe_pickle_extra_state_enabled():
            return pickle.loads(data)
        raise pickle.UnpicklingError(f"{e}{_UNSAFE_ADVICE}") from None


def _tensor_bytes(t, name):
    if t.dtype != torch.uint8:
        raise TypeError(f"{name}: _extra_state must be a uint8 tensor (TransformerEngine's format), got {t.dtype}")
    t = t.detach().reshape(-1).contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.numel())


def _load_bytesio(buf, name):
    """TE 1.x's io.BytesIO (torch.save of the state), by torch's
    weights-only loader, which also builds this package's recipes."""
    buf.seek(0)
    recipes = [getattr(_recipe, n) for n in _RECIPE_CLASSES]
    try:
        with torch.serialization.safe_globals(recipes):
            return torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if unsafe_pickle_extra_state_enabled():
            buf.seek(0)
            return torch.load(buf, map_location="cpu", weights_only=False)
        raise pickle.UnpicklingError(f"{name}: refusing the checkpoint's _extra_state (io.BytesIO): it holds more "
                                     f"than the FP8 checkpoint format ({_weights_only_detail(e)}){_UNSAFE_ADVICE}"
                                     ) from None


def _checked_recipe(r, name):
    """`r` rebuilt through its constructor (its checks run; attributes that
    are not this package's fields, e.g. newer TE fields, are dropped)."""
    if not isinstance(r, _recipe.Recipe):
        raise ValueError(f"{name}: the checkpoint's FP8 recipe is a {type(r).__name__}, not a recipe")
    if isinstance(r, _recipe.DelayedScaling) and (not isinstance(getattr(r, "amax_compute_algo", "max"), str)
                                                  or getattr(r, "scaling_factor_compute_algo", None) is not None):
        raise ValueError(f"{name}: the checkpoint's DelayedScaling has a callable amax_compute_algo or "
                         "scaling_factor_compute_algo, which is not loaded from a checkpoint")

    def rebuild(obj):
        kwargs = {}
        for f in dataclasses.fields(obj):
            if f.name in vars(obj):
                v = vars(obj)[f.name]
                kwargs[f.name] = rebuild(v) if isinstance(v, (_recipe.QParams, _recipe.MMParams)) else v
        return type(obj)(**kwargs)

    try:
        return rebuild(r)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ValueError(f"{name}: the checkpoint's FP8 recipe is not usable here: {e}") from e


def _checked_scaling(state, num_gemms, name):
    """The four scaling tensors as float32, their shapes those of a module
    of num_gemms GEMMs."""
    out = {}
    for key in _SCALING_KEYS:
        t = state.get(key)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: the checkpoint's delayed-scaling state has no tensor {key!r}")
        n = (3 if key.endswith("fwd") else 2) * num_gemms
        ok = t.shape == (n,) if key.startswith("scale") else (t.dim() == 2 and t.shape[1] == n and t.shape[0] >= 1)
        if not ok:
            want = f"[{n}]" if key.startswith("scale") else f"[history, {n}]"
            raise ValueError(f"{name}: the checkpoint's {key} has shape {list(t.shape)}, expected {want} "
                             f"(a module of {num_gemms} GEMM{'s' if num_gemms > 1 else ''})")
        out[key] = t.to(torch.float32)
    return out


def _fits(meta, num_gemms, length, device):
    fwd = meta.get("scaling_fwd") if meta else None
    return (fwd is not None and fwd.scale.numel() == 3 * num_gemms and fwd.amax_history.shape[0] == length
            and fwd.scale.device == device)


def set_extra_state(module, state):
    """Load `state` (a module's `_extra_state`) into `module`'s fp8_meta:
    None or an empty tensor is nothing to load; a uint8 tensor or TE 1.x's
    io.BytesIO is unpickled by the restricted unpickler. Under delayed
    scaling the fp8_meta (kept when its layout fits, else made anew on the
    parameters' device) takes the checkpoint's scales (scale_inv = 1 / scale)
    and amax histories; under another recipe it keeps just the recipe."""
    name = type(module).__name__
    if state is None or isinstance(state, torch.Tensor) and state.numel() == 0:
        return
    if isinstance(state, torch.Tensor):
        state = loads(_tensor_bytes(state, name))
    elif isinstance(state, io.BytesIO):
        state = _load_bytesio(state, name)
    else:
        raise TypeError(f"{name}: _extra_state must be a uint8 tensor (TransformerEngine's format), "
                        f"got {type(state).__name__}")
    if not state:  # None, or the empty dict of an older stateless save
        return
    if not isinstance(state, dict):
        raise ValueError(f"{name}: the checkpoint's _extra_state holds a {type(state).__name__}, expected a dict")
    if "recipe" in state:
        recipe = _checked_recipe(state["recipe"], name)
    else:  # TE 1.x: delayed scaling, the recipe's history length the checkpoint's
        hist = state.get("amax_history_fwd")
        if not isinstance(hist, torch.Tensor) or hist.dim() != 2:
            raise ValueError(f"{name}: the checkpoint's _extra_state has neither a recipe nor delayed-scaling "
                             "tensors")
        recipe = _recipe.DelayedScaling(amax_history_len=hist.shape[0])
    num_gemms = getattr(type(module), "_fp8_num_gemms", None)
    if num_gemms is None:
        warnings.warn(f"{name}: the checkpoint's _extra_state holds TransformerEngine FP8 metadata "
                      f"({type(recipe).__name__}), which this module does not use; it is ignored", stacklevel=4)
        return
    extra = state.get("extra_fp8_variables") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{name}: the checkpoint's extra_fp8_variables is a {type(extra).__name__}, "
                         "expected a dict")
    meta = getattr(module, "fp8_meta", None)
    if isinstance(recipe, _recipe.DelayedScaling):
        scaling = _checked_scaling(state, num_gemms, name)
        device = module_device(module)
        if not _fits(meta, num_gemms, recipe.amax_history_len, device):
            meta = make_fp8_meta(recipe, num_gemms, device)
            module.fp8_meta = meta
        meta["recipe"] = recipe
        meta["fp8_max_fwd"] = recipe.fp8_format.value.max_fwd
        meta["fp8_max_bwd"] = recipe.fp8_format.value.max_bwd
        with torch.no_grad():
            for d in ("fwd", "bwd"):
                m = meta[f"scaling_{d}"]
                m.scale.copy_(scaling[f"scale_{d}"])
                torch.reciprocal(m.scale, out=m.scale_inv)
                m.amax_history.copy_(fit_history(scaling[f"amax_history_{d}"], recipe.amax_history_len))
    else:
        if meta is None or "scaling_fwd" in meta:
            meta = module.fp8_meta = initial_fp8_meta()
        meta["recipe"] = recipe
    meta.update({k: v for k, v in extra.items()
                 if isinstance(k, str) and k not in _OWNED_KEYS and isinstance(v, _PLAIN)})


# ---------------------------------------------------------------- writing


def get_extra_state(module):
    """`module`'s `_extra_state` in TE's format: the empty uint8 tensor
    without FP8 state, else the pickled state as a uint8 CPU tensor. The
    scaling tensors come to the host in one copy."""
    meta = getattr(module, "fp8_meta", None)
    if not meta or meta.get("recipe") is None:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    state = {"recipe": meta["recipe"]}
    if "scaling_fwd" in meta:
        fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
        parts = (fwd.scale, fwd.amax_history, bwd.scale, bwd.amax_history)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).float() for p in parts]).cpu()
        for key, p, piece in zip(_SCALING_KEYS, parts, flat.split([p.numel() for p in parts])):
            state[key] = piece.view(p.shape).clone()  # each its own storage, pickled once
    extra = {k: v for k, v in meta.items() if k != "buffer_index_and_autocast_key" and isinstance(v, _PLAIN)}
    extra["fp8_checkpoint"] = True  # TE's flag: the module has FP8 state to save
    state["extra_fp8_variables"] = extra
    try:
        data = pickle.dumps(state)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"{type(module).__name__}: the FP8 recipe cannot be pickled into _extra_state ({e}); "
                         "TransformerEngine's format pickles the recipe") from e
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
