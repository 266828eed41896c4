"""A communicator's configuration: the transports and TE method names it
accepts, the bounds of its arguments, and the defaults it reads from the
environment (timeout, fallback thresholds, the SMs its GEMMs leave free),
each checked with a message naming the argument. Used by CommOverlap
(_comm_overlap.py) and the registry (userbuffers.py); tests/test_comm.py and
tests/test_reliability*.py exercise it."""
import operator
import os

import torch
import torch.distributed as dist

from . import _C

_TRANSPORTS = {"shm": _C.TRANSPORT_SHM, "cpu": _C.TRANSPORT_SHM, "cuda_ipc": _C.TRANSPORT_CUDA_IPC,
               "cuda": _C.TRANSPORT_CUDA_IPC}
# TE's `method` names; what each runs is said at _SCHEDULES (_comm_overlap.py).
_METHODS = ("ring_exchange", "pipeline", "bulk")

# Bounds of CommOverlap's arguments: the engine's region (data, staging,
# flags) must be addressable with room to spare; timeouts are finite
# (TEC_COMM_TIMEOUT_MAX of tec.h).
_BUFFER_BYTES_MAX = 2 ** 60
_TIMEOUT_MAX = 1e6


def _int_shape(shape, what):
    """A shape as a tuple of Python ints: each entry an integer (a float or
    a bool is refused, never truncated)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {type(shape).__name__}") from None
    out = []
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__"):
            raise TypeError(f"{what} must be a sequence of ints, got {shape!r}")
        out.append(operator.index(d))
    return tuple(out)


def default_timeout():
    """Seconds every communicator wait may take: $TEC_COMM_TIMEOUT or 60."""
    v = os.environ.get("TEC_COMM_TIMEOUT")
    if not v:
        return 60.0
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"TEC_COMM_TIMEOUT={v!r} is not a number of seconds") from None
    if not t > 0:
        raise ValueError(f"TEC_COMM_TIMEOUT={v!r} must be > 0")
    return t


def _group_rank_size(tp_group, tp_size):
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        if tp_size is not None and tp_size != size:
            raise ValueError(f"tp_size={tp_size} but the tp_group has {size} ranks")
        return rank, size
    if tp_size not in (None, 1):
        raise ValueError(f"tp_size={tp_size} needs torch.distributed to be initialized")
    return 0, 1


# Below these FLOPs per chunk GEMM ([rows, k] @ [k, n], 2*rows*k*n) an
# overlapped schedule has nothing to hide its fixed costs behind (flag waits,
# copy-engine start, tp GEMM launches and, for RS, the reduction), and the
# layers run their non-overlapped path instead. Measured on H200s at TP=2
# (docs/performance-log.md): GEMM+RS lost at 12.9 GFLOP chunks (0.87x) and won
# from 34 GFLOP (1.35-1.40x). AG+GEMM was a coin flip at 12.9 GFLOP (five
# runs, 0.89-1.78x, median 0.99x), lost slightly at 34 GFLOP (0.93x, 0.96x)
# and won from 69 GFLOP: at these sizes the host's time to issue the
# overlapped call, not the GPU's, decides. The CPU transport overlaps every
# size (its GEMMs are slow), which also keeps the CPU tests on the
# overlapped paths.
_MIN_CHUNK_FLOPS = {"cuda": {"ag": 40e9, "rs": 16e9}, "cpu": {"ag": 0.0, "rs": 0.0}}
# SMs a schedule's chunk GEMMs leave free: cuBLAS's persistent GEMM kernels
# fill every SM, and the comm stream's flag kernels and local copies then wait
# for the GEMM's tail (docs/performance-log.md, fourth session).
_GEMM_SM_MARGIN = {"cuda": 2, "cpu": 0}


def _gemm_sm_margin(value, device):
    """value, or $TEC_UB_GEMM_SM_MARGIN, else the device's default: an int >= 0,
    and on CUDA fewer than the device's SMs."""
    name, margin = "gemm_sm_margin", -1
    if value is None:
        value = os.environ.get("TEC_UB_GEMM_SM_MARGIN")
        if not value:
            return _GEMM_SM_MARGIN[device.type]
        name = "TEC_UB_GEMM_SM_MARGIN"
        if value.isdigit():
            margin = int(value)
    elif not isinstance(value, bool):
        try:
            margin = operator.index(value)  # an int, numpy's included; not a float or a string
        except TypeError:
            pass
    if margin < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if margin > 65535:
        raise ValueError(f"{name} must be at most 65535, got {margin}")
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if margin >= sms:
            raise ValueError(f"{name} must be below the {sms} SMs of {device}, got {margin}")
    return margin


def _min_chunk_flops(value, device):
    """{"ag": flops, "rs": flops} from a number (both), a dict, or None
    ($TEC_UB_MIN_CHUNK_FLOPS, a number, else the device's default)."""
    if value is None:
        env = os.environ.get("TEC_UB_MIN_CHUNK_FLOPS")
        if env:
            try:
                value = float(env)
            except ValueError:
                raise ValueError(f"TEC_UB_MIN_CHUNK_FLOPS={env!r} is not a number") from None
        else:
            return dict(_MIN_CHUNK_FLOPS[device.type])
    if isinstance(value, dict):
        bad = set(value) - {"ag", "rs"}
        if bad:
            raise ValueError(f"min_chunk_flops: unknown key(s) {sorted(bad)} (expected 'ag', 'rs')")
        out = dict(_MIN_CHUNK_FLOPS[device.type])
        out.update({k: float(v) for k, v in value.items()})
    else:
        out = {"ag": float(value), "rs": float(value)}
    if any(not v >= 0 for v in out.values()):
        raise ValueError(f"min_chunk_flops must be >= 0, got {value!r}")
    return out


def _check_num_splits(method, num_splits, tp_size):
    """num_splits as TE's ub_cfgs give it: None, or the split the schedules
    really use (tp_size for ring_exchange and pipeline; nothing splits under
    bulk). Anything else raises rather than being ignored."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool):
        raise ValueError(f"num_splits must be an int or None, got {num_splits!r}")
    try:
        num_splits = operator.index(num_splits)
    except TypeError:
        raise ValueError(f"num_splits must be an int or None, got {num_splits!r}") from None
    if method == "bulk":
        raise ValueError(f"num_splits={num_splits} has no meaning for method='bulk' (no GEMM is split); "
                         "leave it None")
    if num_splits != tp_size:
        raise ValueError(f"num_splits={num_splits} is not supported for method={method!r}: its overlapped "
                         f"GEMMs always run in tp_size={tp_size} chunks, one per rank (pass None or {tp_size})")
    return num_splits
