"""Delayed scaling's per-module state, TE's `fp8_meta` layout, and its
update rule.

A module's fp8_meta is a dict:
  "recipe"            the DelayedScaling it was made for
  "scaling_fwd"       FP8TensorMeta of the forward roles (FP8FwdTensors)
  "scaling_bwd"       FP8TensorMeta of the backward roles (FP8BwdTensors)
  "fp8_max_fwd", "fp8_max_bwd"   the formats' largest values
  "fp8_group"         the group its amaxes are reduced over (None: the world)
  "num_gemms"         how many GEMMs the module runs
An FP8TensorMeta holds, for n tensor roles, float32 tensors on the
module's device: scale [n], scale_inv [n] and amax_history
[amax_history_len, n], whose row 0 collects the current step's amaxes (a
Float8Quantizer of role i maxes into amax_history[0][i]).

The update (amax_and_scale_update), run once per step for every meta that
took part, is TE's: amax = max over the history, NaN entries skipped as
TE's fmaxf does (or its row 0 with
"most_recent", or the recipe's callable); scale = fp8_max / amax /
2^margin (or the recipe's scaling_factor_compute_algo), the old scale kept
where amax is 0, inf or NaN, FLT_MAX where the quotient overflows;
scale_inv = 1 / scale; then the history rolls one row up (row 0 goes to
the end) and the new row 0 is zeroed. Everything is tensor operations on
the device: no value goes to the host, so a CUDA graph can replay it."""
import enum

import torch

from . import _fp8_engine
from .recipe import DelayedScaling, Format

__all__ = ["FP8FwdTensors", "FP8BwdTensors", "FP8TensorMeta", "make_fp8_meta", "amax_and_scale_update",
           "fp8_dtype_of"]

_FLT_MAX = torch.finfo(torch.float32).max


class FP8FwdTensors(enum.IntEnum):
    """Forward tensor roles, three per GEMM (TE's numbering)."""
    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """Backward tensor roles, two per GEMM (TE's numbering)."""
    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


def fp8_dtype_of(fp8_format, forward):
    """torch's float8 dtype of a recipe format for the forward or backward."""
    if fp8_format is Format.E4M3 or (fp8_format is Format.HYBRID and forward):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


class FP8TensorMeta:
    """scale, scale_inv and amax_history of n tensor roles (TE's names)."""

    __slots__ = ("scale", "scale_inv", "amax_history")

    def __init__(self, n=0, history_len=1, device=None):
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.scale_inv = torch.ones(n, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(history_len, n, dtype=torch.float32, device=device)

    @classmethod
    def of(cls, scale, scale_inv, amax_history):
        """A meta over existing tensors (no copies)."""
        meta = cls.__new__(cls)
        meta.scale, meta.scale_inv, meta.amax_history = scale, scale_inv, amax_history
        return meta

    def __repr__(self):
        return (f"FP8TensorMeta(n={self.scale.numel()}, history_len={self.amax_history.shape[0]}, "
                f"device={self.scale.device})")


def initial_fp8_meta():
    """A module's fp8_meta from its construction, TE's: whether it has FP8
    state to checkpoint (not yet) and its amax reduction group (none yet).
    The recipe and, under delayed scaling, the scaling tensors join it at
    the first FP8 call (module/_fp8.py) or with FP8 primary weights."""
    return {"fp8_checkpoint": False, "fp8_group": None}


def make_fp8_meta(recipe, num_gemms=1, device=None):
    """A fresh fp8_meta for a module of num_gemms GEMMs under `recipe`."""
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"make_fp8_meta: the fp8_meta layout is delayed scaling's, got {type(recipe).__name__}")
    if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or not 1 <= num_gemms <= 3:
        raise ValueError(f"make_fp8_meta: num_gemms must be 1, 2 or 3, got {num_gemms!r}")
    n = recipe.amax_history_len
    return {
        "fp8_checkpoint": False,
        "recipe": recipe,
        "fp8_group": None,
        "num_gemms": num_gemms,
        "scaling_fwd": FP8TensorMeta(3 * num_gemms, n, device),
        "scaling_bwd": FP8TensorMeta(2 * num_gemms, n, device),
        "fp8_max_fwd": recipe.fp8_format.value.max_fwd,
        "fp8_max_bwd": recipe.fp8_format.value.max_bwd,
    }


def fit_history(h, length):
    """TE's rule for an amax history of another length: its first `length`
    rows (row 0, the newest, first), or zero rows appended."""
    if h.shape[0] > length:
        return h[:length]
    return torch.nn.functional.pad(h, (0, 0, 0, length - h.shape[0])) if h.shape[0] < length else h


def module_device(module):
    """The device of a module's parameters (the CPU without any): where its
    fp8_meta lives."""
    for p in module._parameters.values():  # parameters()'s first, without its walk over the submodules
        if p is not None:
            return p.device
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _amax_from_history(history, algo):
    if callable(algo):
        return algo(history)
    if algo == "most_recent":
        return history[0]
    # TE's fused update takes the max with fmaxf: NaN entries are skipped.
    return torch.where(history.isnan(), torch.zeros_like(history), history).max(dim=0).values


def default_scale_from_amax(amax, scale, fp8_max, recipe):
    """TE's rule: fp8_max / amax / 2^margin where amax is finite and > 0,
    else the old scale; FLT_MAX where the quotient is inf."""
    # IEEE division (a float divided by a tensor is a reciprocal and a product in torch, an ulp off)
    # (and a tensor divisor: on CUDA a tensor divided by a number is a product with its reciprocal)
    sf = torch.full_like(amax, fp8_max) / amax
    if recipe.margin:
        sf = sf / torch.full_like(sf, 2.0 ** recipe.margin)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, _FLT_MAX), sf)
    keep = ~(torch.isfinite(amax) & (amax > 0))
    return torch.where(keep, scale, sf)


def _engine_rule(history, recipe):
    return (recipe.scaling_factor_compute_algo is None and recipe.amax_compute_algo in ("max", "most_recent")
            and history.shape[0] <= _fp8_engine.HISTORY_MAX and history.is_contiguous())


def _engine_update(meta, fp8_max, recipe):
    """The rule's engine arguments over meta's tensors (for
    _fp8_engine.delayed_updates_call)."""
    return (meta.amax_history, meta.scale, meta.scale_inv, fp8_max, 2.0 ** recipe.margin,
            recipe.amax_compute_algo == "most_recent")


def updater(metas, fp8_max, recipe):
    """A function of no arguments that runs amax_and_scale_update over
    `metas` (FP8TensorMeta over tensors whose storage stays), the engine's
    arguments checked once here: the step's update of the registered
    fp8_meta tensors, without the per-call checks."""
    if all(_engine_rule(m.amax_history, recipe) for m in metas):
        return _fp8_engine.delayed_updates_call([_engine_update(m, fp8_max, recipe) for m in metas])

    def run_each():
        for m in metas:
            amax_and_scale_update(m, fp8_max, recipe)
    return run_each


def amax_and_scale_update(meta, fp8_max, recipe):
    """Update one FP8TensorMeta in place for the step that just ended (the
    rule in this module's docstring). In-place copies keep every tensor's
    storage, so quantizers holding views of scale / amax_history stay valid."""
    history = meta.amax_history
    algo = recipe.amax_compute_algo
    if _engine_rule(history, recipe):  # the same rule in one engine call (no op per step of the rule)
        _fp8_engine.delayed_update(*_engine_update(meta, fp8_max, recipe))
        return
    amax = _amax_from_history(history, algo)
    if recipe.scaling_factor_compute_algo is None:
        new_scale = default_scale_from_amax(amax, meta.scale, fp8_max, recipe)
    else:
        new_scale = recipe.scaling_factor_compute_algo(amax, meta.scale, fp8_max, recipe)
    meta.scale.copy_(new_scale)
    torch.reciprocal(meta.scale, out=meta.scale_inv)
    if history.shape[0] > 1:
        history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()
