"""Userbuffers: communicators whose buffers are mapped into every rank of a
tensor-parallel group, and the comm-GEMM overlap schedules that run on them.

`CommOverlap` (_comm_overlap.py) is one communicator (explicit object first);
`initialize_ub`, `get_ub` and `destroy_ub` here are a thin TE-compatible
registry of them, keyed by TE's layer names, with TE's `ub_cfgs` parsing and
the release of every communicator at interpreter exit. The schedules, flags
and transports live in C (csrc/core/comm.c, csrc/core/cpu/shm_transport.c).
tests/test_comm.py exercises the registry.

Lifetime: `get_buffer()` returns a non-owning view; the next operation on the
communicator overwrites it. Save copies or local chunks for backward, never a
buffer view.
"""
import atexit
import gc

import torch
import torch.distributed as dist

from ._comm_config import _METHODS, _group_rank_size, default_timeout  # noqa: F401 - default_timeout: a public name
from ._comm_overlap import CommOverlap, CommTimeoutError
from .distributed import close_engine_collectives

__all__ = ["CommOverlap", "CommTimeoutError", "initialize_ub", "get_ub", "destroy_ub", "LAYER_NAMES"]

# ------------------------------------------------------------ the registry

LAYER_NAMES = ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "proj_wgrad",
               "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad")
_DEFAULT_METHOD = {
    "qkv_fprop": "ring_exchange", "fc1_fprop": "ring_exchange", "proj_dgrad": "ring_exchange",
    "fc2_dgrad": "ring_exchange", "proj_fprop": "pipeline", "fc2_fprop": "pipeline",
}
# TE's ub_cfgs keys (README, "TE's ub_cfgs"):
#   used:     method, num_splits (checked by CommOverlap), timeout (ours),
#             fp8_buf (below).
#   accepted, no effect, for a stated reason (values type-checked):
#     num_sm, cga_size, comm_priority, gemm_priority -- size and schedule TE's
#       comm kernels and streams; here copy engines (CUDA) or a comm thread
#       (CPU) move the data, and no kernel of ours has those knobs;
#     set_sm_margin -- every communicator's chunk GEMMs leave gemm_sm_margin
#       SMs free (initialize_ub's argument), whatever this says;
#     is_reduce_scatter -- every communicator does both directions;
#     use_ce=True -- the CUDA transport always copies with the copy engines;
#     fp8_buf, except where used -- used for proj_fprop and fc2_fprop with
#       the pipeline method (as TE): their FP8 communicators send FP8
#       partials in a DelayedScaling forward (_fp8_partials); elsewhere an
#       FP8 call all-gathers FP8 bytes through the FP8 communicators whatever
#       it says, and other reduce-scatters' partials stay in the compute
#       dtype (docs/fp8.md);
#   refused when set (they would change what runs): aggregate,
#     pipeline_rs_overlap_first_gemm, atomic_gemm, use_ce=False.
_CFG_NOOP_INT = {"num_sm": 0, "cga_size": 1, "comm_priority": None, "gemm_priority": None}  # key: minimum
_CFG_NOOP_BOOL = ("set_sm_margin", "is_reduce_scatter", "fp8_buf")
_CFG_REFUSED = {"aggregate": "aggregating two chunks per ring step is not implemented",
                "pipeline_rs_overlap_first_gemm": "the push reduce-scatter has no separate first-GEMM overlap",
                "atomic_gemm": "atomic GEMMs are not supported"}
_CFG_KEYS = {"method", "num_splits", "timeout", "use_ce", *_CFG_NOOP_INT, *_CFG_NOOP_BOOL, *_CFG_REFUSED}


def _check_ub_cfg(layer, cfg):
    """One layer's ub_cfgs entry: known keys, each used, a documented no-op,
    or refused when set (see _CFG_KEYS above)."""
    if layer not in LAYER_NAMES:
        raise ValueError(f"ub_cfgs: unknown layer name {layer!r} (known: {', '.join(LAYER_NAMES)})")
    if not isinstance(cfg, dict):
        raise TypeError(f"ub_cfgs[{layer!r}] must be a dict, got {type(cfg).__name__}")
    for key, val in cfg.items():
        where = f"ub_cfgs[{layer!r}][{key!r}]"
        if key not in _CFG_KEYS:
            raise ValueError(f"ub_cfgs[{layer!r}]: unknown key {key!r}")
        if key in _CFG_NOOP_INT:
            lo = _CFG_NOOP_INT[key]
            if isinstance(val, bool) or not isinstance(val, int) or (lo is not None and val < lo):
                raise ValueError(f"{where} must be an int{'' if lo is None else f' >= {lo}'}, got {val!r}")
        elif key in (*_CFG_NOOP_BOOL, "use_ce") and not isinstance(val, (bool, int)):
            raise ValueError(f"{where} must be a bool, got {val!r}")
        elif key in _CFG_REFUSED and val:
            raise ValueError(f"{where}={val!r}: {_CFG_REFUSED[key]}")
        elif key == "use_ce" and not val:
            raise ValueError(f"{where}={val!r}: the CUDA transport always copies with the copy engines")
    if cfg.get("method", "bulk") not in _METHODS:
        raise ValueError(f"ub_cfgs[{layer!r}]['method'] must be one of {_METHODS}, got {cfg['method']!r}")


_registry = {}      # layer name -> the communicator of the compute dtype
_registry_fp8 = {}  # layer name -> the one FP8 calls use (quantization mode FP8)
# In mode FP8 the communicators that all-gather FP8 bytes (a column layer's
# input, a row layer's dY) have uint8 buffers, as TE's; the others
# reduce-scatter partials of the compute dtype (and a column layer's bulk
# all-gather of FP8 bytes for wgrad fits in its dgrad buffer), so they keep it.
_FP8_GATHERS = ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad")
# With fp8_buf, the row layers' forward reduce-scatters send FP8 partials.
_FP8_PARTIALS = ("proj_fprop", "fc2_fprop")


def _fp8_partials(mode, layer, method, cfg):
    """Whether the communicator sends FP8 partials in a row layer's FP8
    forward reduce-scatter: TE's fp8_buf, which TE honours for the pipeline
    method, on the FP8 communicators of proj_fprop and fc2_fprop."""
    return mode == "fp8" and layer in _FP8_PARTIALS and method == "pipeline" and bool(cfg.get("fp8_buf", False))


def initialize_ub(shape, tp_size, *, dtype=torch.bfloat16, ub_cfgs=None, tp_group=None, transport="auto",
                  device=None, timeout=None, use_fp8=False, min_chunk_flops=None, gemm_sm_margin=None,
                  modes=("none",)):
    """Create one communicator per TE layer name and mode (collective over
    tp_group). shape: [sequence * batch, hidden] of the full (gathered)
    activations. ub_cfgs: {layer name: {method, num_splits, ...}} as in TE.
    modes: "none" (buffers of `dtype`) and/or "fp8" (the communicators FP8
    calls use, get_ub(name, use_fp8=True): uint8 buffers of the same shape
    where they all-gather FP8 bytes, _FP8_GATHERS); use_fp8 adds "fp8"."""
    if _registry or _registry_fp8:
        raise RuntimeError("initialize_ub() was already called; call destroy_ub() first")
    modes = list(dict.fromkeys(list(modes) + (["fp8"] if use_fp8 else [])))
    if not modes or any(m not in ("none", "fp8") for m in modes):
        raise ValueError(f"initialize_ub: modes must be a non-empty list of 'none' and 'fp8', got {modes!r}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise ValueError(f"shape must be [sequence * batch, hidden], got {shape}")
    ub_cfgs = dict(ub_cfgs or {})
    for layer, cfg in ub_cfgs.items():
        _check_ub_cfg(layer, cfg)
    comms = []
    made = [(mode, layer) for mode in modes for layer in LAYER_NAMES]
    try:
        try:
            for mode, layer in made:
                cfg = ub_cfgs.get(layer, {})
                fp8_bytes = mode == "fp8" and layer in _FP8_GATHERS
                method = cfg.get("method", _DEFAULT_METHOD.get(layer, "bulk"))
                c = CommOverlap(shape, torch.uint8 if fp8_bytes else dtype, tp_group=tp_group, tp_size=tp_size,
                                name=layer if mode == "none" else f"{layer}_fp8",
                                timeout=cfg.get("timeout", timeout), transport=transport, device=device,
                                method=method, num_splits=cfg.get("num_splits"), min_chunk_flops=min_chunk_flops,
                                gemm_sm_margin=gemm_sm_margin, fp8_buf=_fp8_partials(mode, layer, method, cfg),
                                _exchange=False)
                comms.append(c)
        except (MemoryError, OSError, RuntimeError) as e:  # the engine's failures: the peers learn of them
            _, size = _group_rank_size(tp_group, tp_size)
            CommOverlap._exchange([], tp_group, size=size, failed=e)
        CommOverlap._exchange(comms, tp_group)
    except BaseException:
        for c in comms:
            c.close()
        raise
    for (mode, layer), c in zip(made, comms):
        (_registry if mode == "none" else _registry_fp8)[layer] = c


def get_ub(name, use_fp8=False):
    """The communicator of a TE layer name created by initialize_ub(): the
    FP8 one with use_fp8 (quantization mode FP8)."""
    reg = _registry_fp8 if use_fp8 else _registry
    if not _registry and not _registry_fp8:
        raise RuntimeError("userbuffers are not initialized: call initialize_ub() first")
    if not reg:
        raise KeyError(f"get_ub({name!r}, use_fp8={bool(use_fp8)}): initialize_ub made no communicators of "
                       f"quantization mode {'FP8' if use_fp8 else 'NONE'}")
    try:
        return reg[name]
    except KeyError:
        raise KeyError(f"no communicator named {name!r} (known: {', '.join(reg)})") from None


def has_fp8_ub():
    """Whether initialize_ub made FP8 communicators."""
    return bool(_registry_fp8)


def close_comms(comms, tp_group=None):
    """Close communicators of one tensor-parallel group safely (collective:
    every rank calls it with the same communicators): each rank finishes its
    work and unmaps its peers, all ranks meet, then each frees its region, so
    no region is freed while a peer still maps it. CommOverlap.close() alone is
    local and right when the whole group is going away anyway."""
    comms = [c for c in comms if not c.closed]
    first = None
    for c in comms:  # unmap every one, even if one fails, before meeting the peers
        try:
            c._unmap_peers(c._stream())
        except Exception as e:
            first = first or e
    if comms and comms[0].tp_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier(group=tp_group if tp_group is not None else comms[0].tp_group)
    for c in comms:
        c.close()
    if first is not None:
        raise first


def destroy_ub():
    """Close every registered communicator (collective, like initialize_ub)."""
    comms = list(_registry.values()) + list(_registry_fp8.values())
    _registry.clear()
    _registry_fp8.clear()
    close_comms(comms)


def _release_at_exit():
    """atexit: release what this package holds while the interpreter is
    still whole. Communicators (ours, in the registry and in reference
    cycles through layers) keep their tp_group alive; a process group whose
    last reference goes in the interpreter's final collection joins gloo's
    worker threads after Python has started finalizing, and a worker that
    then drops a finished collective (whose thread-local state holds Python
    objects, e.g. saved-tensor hooks) must take the GIL and exits the thread
    from inside a destructor: "terminate called without an active
    exception". Closing locally (no collective: the peers may be gone) and
    collecting here lets the group go while its threads can still finish."""
    try:  # their watchdogs stop before CUDA goes; they also hold process groups
        close_engine_collectives(abort=True)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass

    for c in list(_registry.values()) + list(_registry_fp8.values()):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    _registry.clear()
    _registry_fp8.clear()
    gc.collect()


atexit.register(_release_at_exit)
