"""Tensors that live only within one layer call's engine calls: the
temporaries (one per role, shape and stream, reused across calls where that
is safe) and the statistics sink of a no-grad forward's norm.

The steps (module/_steps.py, module/_fp8_gemm.py) take them; tests/test_one_path.py
exercises the reuse rules.
"""
import threading
from math import prod as _prod

import torch

_F32 = torch.float32
_U8 = torch.uint8
_empty = torch.empty

# Tensors that live only until the GEMM, kernel or collective that reads them
# within the same call, all in the calling stream's order (a collective's
# stream waits for it, and it for the collective): a forward's gathered input
# and its partial product before the reduce-scatter (without grad also the
# norm's output); in backward the gathered dY and input, the dgrad before its
# reduce-scatter, the norm's and activation's gradients and workspaces. Where a
# call is all host work (small shapes), each thread keeps one tensor per
# (role, shape, dtype, device, stream) and reuses it instead of allocating one
# per call: the next call's writes are ordered after this call's reads, and
# two roles never share a tensor. Not while a CUDA graph is captured (its
# replays, on any stream, would share the tensor with eager calls), not above
# _TEMP_BYTES (memory held between calls), at most _TEMP_SLOTS and _TEMP_HELD
# bytes per thread (the oldest dropped first), and not on a CUDA device inside
# the operators torch.compile runs (`fresh`: PyTorch's CUDA graphs of
# mode="reduce-overhead" warm up and record in a memory pool of their own, in
# which nothing may stay alive between calls; CPU tensors have no such pool and
# are reused there too). Tensors that outlive the call (outputs, what backward
# saves, a delayed wgrad's operands) are never temporaries.
_TEMP_BYTES = 16 << 20
_TEMP_SLOTS = 32
_TEMP_HELD = 64 << 20
_temps = threading.local()
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
(T_GATHERED, T_PARTIAL, T_DGRAD, T_WGRAD_INPUT, T_DY, T_DACT, T_DH, T_DLN, T_ACT_WS, T_NORM_WS, T_LN_OUT,
 T_FC1_OUT, T_ACT_OUT, T_FP8) = range(14)


def temp(x, shape, dev, stream, role, dtype=None):
    """A tensor of `shape` with x's device and dtype (or `dtype`) for the
    temporary `role`, read and written in `stream`'s order; dev: the engine's
    device code."""
    dtype = dtype or x.dtype
    if _prod(shape) * dtype.itemsize > _TEMP_BYTES or dev >= 0 and (_capturing is None or _capturing()):
        return x.new_empty(shape, dtype=dtype)
    slots = getattr(_temps, "slots", None)
    if slots is None:
        slots = _temps.slots = {}
        _temps.fresh = False
    if _temps.fresh and dev >= 0:
        return x.new_empty(shape, dtype=dtype)
    key = (role, shape, dtype, dev, stream)
    t = slots.get(key)
    if t is None:
        t = x.new_empty(shape, dtype=dtype)
        held = t.nbytes + sum(u.nbytes for u in slots.values())  # only when a temporary is added
        for old in list(slots):  # the oldest first
            if len(slots) < _TEMP_SLOTS and held <= _TEMP_HELD:
                break
            held -= slots.pop(old).nbytes
        slots[key] = t
    return t


def temp_bytes(x, nbytes, dev, stream, role):
    """A uint8 [nbytes] workspace on x's device: a temporary."""
    return temp(x, (nbytes,), dev, stream, role, _U8)


# Where a no-grad forward's norm writes its statistics: nothing reads them, so
# one float32 buffer per device serves every call and stream (writes racing
# into it are harmless) instead of an allocation per call. An outgrown buffer
# stays alive: a captured CUDA graph may still write to it.
_sinks = {}
_outgrown_sinks = []


def fresh_temporaries(on):
    """Whether every temporary and statistics sink on a CUDA device is a
    fresh allocation from now on in this thread (the operators torch.compile
    runs: see the temporaries' comment); returns the setting it replaces."""
    if getattr(_temps, "slots", None) is None:
        _temps.slots = {}
    before, _temps.fresh = getattr(_temps, "fresh", False), on
    return before


def _stats_sink(device, count):
    t = _sinks.get(device)
    if t is None or t.numel() < count:
        if t is not None:
            _outgrown_sinks.append(t)
        t = _sinks[device] = _empty(max(count, 4096, 0 if t is None else 2 * t.numel()), dtype=_F32, device=device)
    return t.data_ptr()


def norm_stats(device, rows, rms, keep):
    """(stats, its address) for a norm over `rows` rows: a fresh float32
    [2 * rows] (LayerNorm: mu, then rsigma) or [rows] (RMSNorm) when
    backward keeps it (or temporaries on a CUDA device are fresh), else
    (None, the statistics sink's address)."""
    count = rows if rms else 2 * rows
    if keep or device.type != "cpu" and _temps.__dict__.get("fresh"):
        stats = _empty(count, dtype=_F32, device=device)
        return stats, stats.data_ptr()
    return None, _stats_sink(device, count)
