"""Tensor-parallel plumbing over torch.distributed: group resolution and the
non-overlapped sequence-parallel collectives (along the first dimension of a
2-D token-major tensor), through the process group or, for CUDA tensors with
`set_collectives("engine")`, through the engine's own NCCL communicator;
and, as TE's `transformer_engine.pytorch.distributed`, its first-dimension
collectives, with its RNG tracker and checkpointing re-exported
(te_distributed.py, checkpoint.py)."""
import os
import pickle
import threading

import torch
import torch.distributed as dist

from . import _C
from ._engine import DTYPE_CODES, _raw_stream, device_code
# TE's transformer_engine.pytorch.distributed names beyond the plumbing here
from .checkpoint import checkpoint  # noqa: F401
from .te_distributed import (  # noqa: F401
    CudaRNGStatesTracker, activation_recompute_forward, get_all_rng_states, in_fp8_activation_recompute_phase,
    is_fp8_activation_recompute_enabled)

# The layers' collectives call the process group's own methods: torch.distributed's
# functions add their Python (argument checks, group lookups, logging wrappers) on
# top of them: 1-2.5 µs per call with NCCL on an H200 host, 15-30 µs with gloo on a
# small CPU (scripts/experiments/collective_host_cost.py). Only groups this rank
# belongs to reach here (resolve_tp). A group without the methods takes
# torch.distributed's functions; PyTorch 2.13 renamed the flat ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------- engine collectives
#
# "auto" (the default): the layers' collectives on CUDA tensors go through
# the engine's own NCCL communicator when their group's process group is
# NCCL's (and the engine can load NCCL >= 2.10), else through the process
# group. "engine": every CUDA collective through the engine. "torch": all
# through the process group.
# The engine keeps one communicator per (group, device), created on the
# group's first such collective (every rank gets there in the same order: its
# unique id is broadcast over the group) and enqueued on the current stream
# from C (csrc/core/cuda/nccl.cu): no process-group work object, stream
# hand-off or tensor bookkeeping per call. An asynchronous one runs on the
# communicator's side stream after the current stream's work so far; its
# wait() makes the current stream wait. A collective unfinished `timeout_s`
# after it was enqueued ends the process with a message naming it (the
# watchdog; as PyTorch's NCCL process group does by default). CPU tensors
# always take the process group.
_KINDS = ("auto", "torch", "engine")
_C_ALL_GATHER, _C_REDUCE_SCATTER, _C_ALL_REDUCE = 0, 1, 2  # tec.h's TEC_NCCL_*
_collectives = {"kind": "auto", "timeout_s": 600.0}
_engine_comms = {}  # (group, CUDA ordinal) -> (capsule of the engine's communicator, ranks)
_auto_groups = {}  # group -> whether "auto" sends its CUDA collectives to the engine
_engine_lock = threading.Lock()  # making one (the forward's and autograd's threads may both get there)


def set_collectives(kind, timeout_s=None):
    """Route the layers' collectives on CUDA tensors (sequence parallelism's
    all-gathers and reduce-scatters, the row layers' all-reduce,
    allreduce_sequence_parallel_grads): "auto" (the default) through the
    engine's own NCCL communicator where the group's process group is NCCL's,
    "engine" always through it, "torch" through the process group.
    `timeout_s` bounds each engine collective and the communicator's creation
    (default 600). Call it the same way on every rank, before the layers run
    (the TEC_COLLECTIVES and TEC_COLLECTIVES_TIMEOUT environment variables set
    the same at import)."""
    if kind not in _KINDS:
        raise ValueError(f"collectives must be one of {_KINDS}, got {kind!r}")
    if timeout_s is not None:
        timeout_s = float(timeout_s)
        if not 0 < timeout_s <= 1e6:
            raise ValueError(f"timeout_s must be in (0, 1e6] seconds, got {timeout_s}")
        _collectives["timeout_s"] = timeout_s
    _collectives["kind"] = kind


def collectives():
    """"auto", "torch" or "engine": where the layers' CUDA collectives go (set_collectives)."""
    return _collectives["kind"]


def with_collectives(kind, fn):
    """fn, made to run with the layers' CUDA collectives through `kind`
    ("auto", "torch" or "engine") and the setting found restored afterwards
    (for comparing them in one process: the benchmark, the tests). The
    switch is a dict store each way, cheap enough for timed loops."""
    if kind not in _KINDS:
        raise ValueError(f"collectives must be one of {_KINDS}, got {kind!r}")

    def run(*args, **kw):
        before, _collectives["kind"] = _collectives["kind"], kind
        try:
            return fn(*args, **kw)
        finally:
            _collectives["kind"] = before
    return run


def _engine_for(x, group):
    """Whether a collective of x over `group` goes to the engine's communicator.
    "auto" leaves a group whose communicator does not exist yet on the process
    group while a CUDA graph is being captured (the creation exchanges an id
    and connects the ranks: not capturable); "engine" refuses then
    (_make_engine_comm)."""
    kind = _collectives["kind"]
    if kind == "torch" or not x.is_cuda or x.dtype not in DTYPE_CODES:
        return False
    if kind == "engine":
        return True
    use = _auto_groups.get(group)
    if use is None:
        use = _auto_groups[group] = _nccl_group(group, x.get_device())
    if use and (group, x.get_device()) not in _engine_comms and torch.cuda.is_current_stream_capturing():
        return False  # its creation cannot be captured: this graph keeps the process group's collectives
    return use


def _nccl_group(group, device):
    """"auto"'s choice for `group` (None: the default group): its process
    group moves CUDA tensors with NCCL (backend "nccl", or "cuda:nccl" among
    several), and the engine can load NCCL >= 2.10 (the copy PyTorch loaded)
    on CUDA device `device`. Decided once per group, the same on every rank of
    a uniform installation."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError):  # not a group this rank knows
        return False
    if "nccl" not in backend:
        return False
    device_code(torch.device("cuda", device))  # loads the CUDA backend
    return _C.nccl_version() >= 21000


def close_engine_collectives(abort=False):
    """Destroy the engine's NCCL communicators (each is made again on its group's
    next collective): call it on every rank, with no collective in flight that
    the others have not also issued. With abort, nothing waits for unfinished
    collectives (what the package does at interpreter exit)."""
    comms = list(_engine_comms.values())
    _engine_comms.clear()
    for c, _ in comms:
        _C.nccl_close(c, bool(abort))


def _engine_comm(group, device):
    """(capsule, ranks) of the engine communicator of (group, CUDA ordinal),
    made on first use."""
    key = (group, device)
    with _engine_lock:
        entry = _engine_comms.get(key)
        if entry is None:
            entry = _engine_comms[key] = _make_engine_comm(group, device)
    return entry


def _make_engine_comm(group, device):
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the engine's NCCL communicator of this group is made on its first collective, which cannot be "
            "captured in a CUDA graph (it exchanges an id and connects the ranks): run the layers once "
            "outside the capture first (as torch.cuda.make_graphed_callables' warm-up does)")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    nranks, rank = dist.get_world_size(pg), dist.get_rank(pg)
    dev = torch.device("cuda", device)
    device_code(dev)  # loads the CUDA backend
    uid = _shared_id(pg, dev, _C.nccl_unique_id)
    ranks = dist.get_process_group_ranks(pg)
    label = f"the {nranks}-rank group of global ranks {ranks}"
    return _C.nccl_create(device, uid, nranks, rank, _collectives["timeout_s"], label), nranks


def _shared_id(pg, device, make):
    """Group rank 0's make() (128 bytes) on every rank of pg: broadcast as a
    uint8 tensor on `device` (one the group's backend moves)."""
    uid = torch.zeros(128, dtype=torch.uint8, device=device)
    if dist.get_rank(pg) == 0:
        made = make()
        if len(made) != 128:
            raise RuntimeError(f"a communicator id must be 128 bytes, got {len(made)}")
        uid.copy_(torch.frombuffer(bytearray(made), dtype=torch.uint8))
    dist.broadcast(uid, src=dist.get_global_rank(pg, 0), group=pg)
    return bytes(uid.cpu().tolist())


def all_gather_pickled(obj, group):
    """Every rank's `obj` (picklable), in group rank order. The bytes travel as
    uint8 tensors on a device the group's backend moves (CPU for gloo, the
    current CUDA device for NCCL), so, unlike all_gather_object on some
    PyTorch releases, this needs no numpy."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = str(dist.get_backend(pg)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "gloo" not in backend and "nccl" in backend \
        else torch.device("cpu")
    blob = pickle.dumps(obj)
    size = dist.get_world_size(pg)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(blob)], dtype=torch.int64, device=device), group=pg)
    lengths = [int(n.item()) for n in lengths]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if blob:
        mine[:len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(parts, mine, group=pg)
    return [pickle.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(parts, lengths)]


class _EngineWork:
    """An asynchronous engine collective: wait() makes the stream that issued
    it wait (on the device) for it, as a process group's Work.wait() does.
    It holds the collective's tensors until then: the side stream reads and
    writes them, which PyTorch's allocator does not know (a tensor freed
    earlier could be handed to the issuing stream's next allocation while
    the collective still uses it). Dropped without wait(), it waits then."""
    __slots__ = ("comm", "ticket", "stream", "tensors")

    def __init__(self, comm, ticket, stream, tensors):
        self.comm, self.ticket, self.stream, self.tensors = comm, ticket, stream, tensors

    def wait(self):
        if self.tensors is not None:
            _C.nccl_join(self.comm, self.ticket, self.stream)
            self.tensors = None
        return True

    def __del__(self):
        if self.tensors is not None:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - a closed communicator: nothing runs any more
                self.tensors = None


def _engine_run(op, out, x, group, async_op):
    """One engine collective of x into out (all-gather: out holds every rank's
    x, rank-major; reduce-scatter: x holds every rank's share of the sum;
    all-reduce: in place), checked as the process group checks."""
    device = x.get_device()
    if out.get_device() != device or out.dtype != x.dtype:
        raise ValueError(f"collective: output on cuda:{out.get_device()} ({out.dtype}), input on "
                         f"cuda:{device} ({x.dtype}); expected the same device and dtype")
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("collective: input and output must be contiguous")
    c, nranks = _engine_comms.get((group, device)) or _engine_comm(group, device)
    n_in, n_out = x.numel(), out.numel()
    if op == _C_ALL_GATHER:
        ok, count = n_out == n_in * nranks, n_in
    elif op == _C_REDUCE_SCATTER:
        ok, count = n_in == n_out * nranks, n_out
    else:
        ok, count = True, n_in
    if not ok:
        raise ValueError(f"{('all-gather', 'reduce-scatter')[op]} over {nranks} ranks: input of {n_in} "
                         f"elements, output of {n_out}; expected the "
                         f"{('output', 'input')[op]} {nranks} times the other")
    stream = _raw_stream(device) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream
    ticket = _C.nccl_run(c, op, x.data_ptr(), out.data_ptr(), count, DTYPE_CODES[x.dtype], stream, async_op)
    return _EngineWork(c, ticket, stream, (x, out)) if async_op else None


def _process_group(group):
    """The ProcessGroup object behind `group` (None: the default group), if it
    has the methods the direct calls use."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg if hasattr(pg, "_allgather_base") and hasattr(pg, "_reduce_scatter_base") else None


def _all_gather_into(out, x, group, async_op):
    if _engine_for(x, group):
        return _engine_run(_C_ALL_GATHER, out, x, group, async_op)
    pg = _process_group(group)
    if pg is None:
        return _all_gather_flat(out, x, group=group, async_op=async_op)
    work = pg._allgather_base(out, x)
    if async_op:
        return work
    work.wait()
    return None


def _reduce_scatter_into(out, x, group):
    if _engine_for(x, group):
        _engine_run(_C_REDUCE_SCATTER, out, x, group, False)
        return
    pg = _process_group(group)
    if pg is None:
        _reduce_scatter_flat(out, x, group=group)
    else:
        pg._reduce_scatter_base(out, x).wait()  # the default options: SUM


def resolve_tp(tp_group, tp_size):
    """(group, size, rank) of the tensor-parallel group; checks that an
    explicit tp_size agrees with the group."""
    if tp_group is None:
        if tp_size not in (None, 1):
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"tp_size={tp_size} needs tp_group (or an initialised default "
                                 "process group of that size)")
            if dist.get_world_size() != tp_size:
                raise ValueError(f"tp_size={tp_size} but no tp_group was given and the default "
                                 f"group has {dist.get_world_size()} ranks")
            return dist.group.WORLD, tp_size, dist.get_rank()
        return None, 1, 0
    size = dist.get_world_size(tp_group)
    if tp_size not in (None, 1, size):
        raise ValueError(f"tp_size={tp_size} does not match tp_group, which has {size} ranks")
    return tp_group, size, dist.get_rank(tp_group)


def all_gather_rows(x, group, size, async_op=False):
    """[T, H] on each rank -> [size * T, H], rank-major. With async_op,
    returns (out, work): out is valid after work.wait() (work None if there
    was nothing to wait for)."""
    if size == 1:
        return (x, None) if async_op else x
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather_into(out, x.contiguous(), group, async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(x, group, size):
    """[size * T, H] partial sums on each rank -> this rank's [T, H] of the sum."""
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {x.shape[0]} rows over {size} ranks")
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, x.contiguous(), group)
    return out


def all_reduce(x, group, size):
    if size > 1 and _engine_for(x, group):
        _engine_run(_C_ALL_REDUCE, x, x, group, False)
    elif size > 1:
        pg = _process_group(group)
        if pg is None:
            dist.all_reduce(x, group=group)
        else:
            pg.allreduce([x]).wait()  # the default options: SUM
    return x


def allreduce_sequence_parallel_grads(*modules):
    """Sum, over each layer's tensor-parallel group, the gradients of the
    parameters that carry `sequence_parallel = True` (norm weights and
    biases, a row layer's bias): under sequence parallelism each rank's
    gradient of those is a partial sum over its own tokens. This is the step
    Megatron's finalize_model_grads runs for TransformerEngine layers; call
    it after backward (and before the optimizer) in other training loops,
    with the model (or several modules).
    A module without a group of its own (a TransformerLayer's output
    LayerNorm) uses the group of the nearest enclosing module that has one.
    One all-reduce per group, of all such gradients flattened together
    (collective: every rank of a group must hold the same gradients)."""
    def walk(m, inherited):
        tp = getattr(m, "tp", None) or inherited
        yield m, tp
        for child in m.children():
            yield from walk(child, tp)

    by_group, seen = {}, set()
    for m, tp in (pair for module in modules for pair in walk(module, None)):
        if tp is None or getattr(tp, "size", 1) == 1:
            continue
        for p in m.parameters(recurse=False):
            if getattr(p, "sequence_parallel", False) and p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                by_group.setdefault(id(tp.group), (tp.group, []))[1].append(p.grad)
    for group, grads in by_group.values():
        all_reduce_coalesced(grads, group)


def all_reduce_coalesced(tensors, group, dtype=None):
    """Sum each of `tensors` in place over `group` in one all-reduce of them
    flattened together (in `dtype` when given, e.g. float32 for 16-bit
    gradients; else torch's promotion of theirs)."""
    flat = torch.cat([t.reshape(-1) if dtype is None else t.reshape(-1).to(dtype) for t in tensors])
    all_reduce(flat, group, dist.get_world_size(group))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


set_collectives(os.environ.get("TEC_COLLECTIVES", "auto") or "auto",
                os.environ.get("TEC_COLLECTIVES_TIMEOUT") or None)


# ------------------------------------------- TE's first-dimension collectives

def _group_size(group):
    return dist.get_world_size(group) if group is not None or dist.is_initialized() else 1


def gather_along_first_dim(inp, process_group, async_op=False, quantizer=None, output_tensor=None,
                           external_coalescing=False):
    """TE's all-gather of `inp` along its first dimension over
    `process_group`, rank-major: (output, work) with work None unless
    async_op (then output is valid after work.wait())."""
    if quantizer is not None:
        raise NotImplementedError("gather_along_first_dim(quantizer=...): quantized gathers (FP8) are not "
                                  "supported")
    size = _group_size(process_group)
    if size == 1:
        return inp, None
    shape = (inp.shape[0] * size,) + tuple(inp.shape[1:])
    if output_tensor is None:
        out = torch.empty(shape, dtype=inp.dtype, device=inp.device)
    else:
        if tuple(output_tensor.shape) != shape or output_tensor.dtype != inp.dtype:
            raise ValueError(f"gather_along_first_dim: output_tensor must be {shape} of {inp.dtype}, got "
                             f"{tuple(output_tensor.shape)} of {output_tensor.dtype}")
        out = output_tensor
    work = _all_gather_into(out, inp.contiguous(), process_group, async_op)
    return out, work if async_op else None


def reduce_scatter_along_first_dim(inp, tp_group, async_op=False):
    """TE's reduce-scatter along the first dimension: (this rank's share of
    the sum, work or None)."""
    size = _group_size(tp_group)
    if size == 1:
        return inp, None
    if inp.shape[0] % size:
        raise ValueError(f"reduce_scatter_along_first_dim: {inp.shape[0]} rows do not split over {size} ranks")
    out = torch.empty((inp.shape[0] // size,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    work = dist.reduce_scatter_tensor(out, inp.contiguous(), group=tp_group, async_op=async_op)
    return out, work if async_op else None
