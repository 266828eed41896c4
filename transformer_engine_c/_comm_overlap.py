"""CommOverlap: one userbuffers communicator, whose buffer is mapped into
every rank of a tensor-parallel group, and the comm-GEMM overlap schedules
that run on it (csrc/core/comm.c). This module checks arguments, allocates
outputs with PyTorch, gives views of the buffer and does the handle exchange
through torch.distributed; it also holds what keeps a communicator's failures
clear: its one-thread lock and the marker a rank sends when it could not
create its communicators. The TE-style registry over these objects is
userbuffers.py. tests/test_comm.py, tests/test_comm_schedule.py and
tests/test_reliability*.py exercise it.

Lifetime: `get_buffer()` returns a non-owning view; the next operation on the
communicator overwrites it. Save copies or local chunks for backward, never a
buffer view.
"""
import contextlib
import ctypes
import functools
import itertools
import math
import threading

import torch

from . import _C, debug
from ._comm_config import (_BUFFER_BYTES_MAX, _METHODS, _TIMEOUT_MAX, _TRANSPORTS, _check_num_splits,
                           _gemm_sm_margin, _group_rank_size, _int_shape, _min_chunk_flops, default_timeout)
from .distributed import all_gather_pickled
from ._engine import DTYPE_CODES, check_tensor, device_code, stream_of, workspace
from ._fp8_engine import FP8_DTYPES

CommTimeoutError = _C.CommTimeoutError

# TE's `method` names (_METHODS) mapped to the schedules of csrc/core/comm.c
# (README, "TE's ub_cfgs"). Every communicator runs every operation; the method
# changes no code path here: it is checked, kept as CommOverlap.method, and
# stats() counts the schedules that ran by these names.
#   ag_gemm: "pull"  -- tp_size chunk GEMMs; the comm side pulls each peer's
#            chunk straight from the peer's buffer while the GEMM of the
#            previous one runs (own chunk first). TE's ring_exchange relays
#            chunks around a ring in the same tp_size steps.
#   gemm_rs: "push"  -- tp_size chunk GEMMs, one per destination rank; each
#            partial is pushed into its owner's buffer while the next is
#            computed; the owner sums them in float32. TE's pipeline splits
#            into num_splits chunks and reduce-scatters each; here the split
#            is always tp_size.
#   bulk_*:  "bulk"  -- the whole collective on the comm side beside another GEMM.
_SCHEDULES = {"ag_gemm": "pull", "gemm_rs": "push", "bulk_ag": "bulk", "bulk_rs": "bulk"}
_FALLBACK_KEYS = {"ag": "ag_fallback", "rs": "rs_fallback"}
_counter = itertools.count()


# ---------------------------------------------------------------- FP8


class FP8Gemm:
    """The FP8 side of an overlap call (ag_gemm / gemm_rs with fp8=): the
    input and the weight are torch.uint8 tensors of FP8 bytes in the formats
    a_dtype and b_dtype (torch.float8_e4m3fn or torch.float8_e5m2, not both
    E5M2), each with one float32 scale_inv (the value is scale_inv * byte);
    the weight is stored [n, k] (transb=True: a dgrad passes the weight's
    transpose). out_dtype is the output's dtype (bfloat16, float16 or
    float32), gemm_rs's partials' and the bias's; fast_accum is cuBLASLt's
    fast FP8 accumulation (TE's fprop; False is the split accumulator). In
    ag_gemm every rank's chunk must have been cast with the same scale: the
    gathered input carries one scale_inv."""

    __slots__ = ("a_dtype", "a_scale_inv", "b_dtype", "b_scale_inv", "out_dtype", "fast_accum")

    def __init__(self, a_dtype, a_scale_inv, b_dtype, b_scale_inv, out_dtype=torch.bfloat16, fast_accum=False):
        for name, d in (("a_dtype", a_dtype), ("b_dtype", b_dtype)):
            if d not in FP8_DTYPES:
                raise TypeError(f"FP8Gemm: {name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {d!r}")
        if a_dtype is torch.float8_e5m2 and b_dtype is torch.float8_e5m2:
            raise ValueError("FP8Gemm: a_dtype and b_dtype cannot both be torch.float8_e5m2")
        for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(f"FP8Gemm: {name} must be a float32 tensor of one element")
        if out_dtype not in DTYPE_CODES:
            raise TypeError(f"FP8Gemm: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
        self.a_dtype, self.a_scale_inv, self.b_dtype, self.b_scale_inv = a_dtype, a_scale_inv, b_dtype, b_scale_inv
        self.out_dtype, self.fast_accum = out_dtype, bool(fast_accum)

    def args(self, device):
        """The engine's five trailing arguments (formats, scale addresses,
        fast_accum), the scales checked to be on device."""
        for name, t in (("a_scale_inv", self.a_scale_inv), ("b_scale_inv", self.b_scale_inv)):
            if t.device != device:
                raise ValueError(f"FP8Gemm: {name} is on {t.device}; expected {device}")
        return (FP8_DTYPES[self.a_dtype], FP8_DTYPES[self.b_dtype], self.a_scale_inv.data_ptr(),
                self.b_scale_inv.data_ptr(), int(self.fast_accum))


_NO_FP8 = (-1, -1, 0, 0, 0)


class FP8Partials:
    """FP8 partials of gemm_rs (TE's fp8_buf): each chunk GEMM writes its
    partial as bytes of dtype (torch.float8_e4m3fn or torch.float8_e5m2),
    fp8(partial * scale), with this rank's scale_inv beside them; the owner
    of each chunk decodes every rank's bytes with that rank's scale_inv and
    sums them in float32 with the bias. amax (optional, a float32 tensor of
    one element, e.g. a row of an amax history) becomes the max of itself and
    of |partial| over every partial this rank computed. Half the bytes of a
    bf16 partial travel, at the cost of one FP8 rounding per partial. One
    rank has no partials: its GEMM writes the output directly."""

    __slots__ = ("dtype", "scale", "scale_inv", "amax")

    def __init__(self, dtype, scale, scale_inv, amax=None):
        if dtype not in FP8_DTYPES:
            raise TypeError(f"FP8Partials: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
        for name, t in (("scale", scale), ("scale_inv", scale_inv), ("amax", amax)):
            if t is None and name == "amax":
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(f"FP8Partials: {name} must be a float32 tensor of one element")
        self.dtype, self.scale, self.scale_inv, self.amax = dtype, scale, scale_inv, amax

    def args(self, device):
        """The engine's four trailing arguments of gemm_rs (format, scale,
        scale_inv and amax addresses), the tensors checked to be on device."""
        for name in ("scale", "scale_inv", "amax"):
            t = getattr(self, name)
            if t is not None and t.device != device:
                raise ValueError(f"FP8Partials: {name} is on {t.device}; expected {device}")
        return (FP8_DTYPES[self.dtype], self.scale.data_ptr(), self.scale_inv.data_ptr(),
                self.amax.data_ptr() if self.amax is not None else 0)


_NO_PARTIALS = (-1, 0, 0, 0)


# ------------------------------------------------- one thread at a time


def _serialised(method):
    """Run the method holding the communicator for the calling thread
    (_OneThread: a second thread arriving meanwhile is refused)."""
    @functools.wraps(method)
    def locked(self, *args, **kw):
        with self._lock:
            return method(self, *args, **kw)
    return locked


class _OneThread:
    """A communicator's hold: one thread at a time, reentrant for it. Ranks
    pair a communicator's operations in the order each rank issues them, and
    two threads in it at once are ordered differently on different ranks, so
    they would pair different calls and compute wrong results with no error.
    A thread that finds the communicator held by another is refused; from then
    on every operation on it is refused on this rank (the holder's current one
    when it ends, the peers' next ones when their waits on this rank time out),
    so a run cannot go on with a wrong pairing. close() still works: closes
    run one at a time (`closer`), and one that finds the communicator closed
    does nothing, so closing again or from several threads is never refused."""
    __slots__ = ("_mu", "_holder", "_depth", "refused", "name", "closer")

    def __init__(self):
        self._mu = threading.Lock()
        self._holder, self._depth, self.refused, self.name = None, 0, None, "?"
        self.closer = threading.RLock()

    def __enter__(self):
        return self._take(closing=False)

    def _take(self, closing):
        me = threading.current_thread()
        with self._mu:
            if self._holder in (None, me) and (self.refused is None or closing):
                self._holder, self._depth = me, self._depth + 1
                return self
            if self.refused is None:
                self.refused = (
                    f"communicator '{self.name}': thread {me.name!r} called it while thread "
                    f"{self._holder.name!r} was in an operation on it. Ranks pair a communicator's operations in the "
                    "order each rank issues them, so two threads in one communicator at once pair different "
                    "calls on different ranks; it now refuses every operation on this rank (close it and make "
                    "another). Give each thread its own communicator, or let the threads take turns in the same "
                    "order on every rank")
            raise RuntimeError(self.refused)

    def _release(self):
        with self._mu:
            self._depth -= 1
            if not self._depth:
                self._holder = None
            return self.refused

    def __exit__(self, kind, value, tb):
        refused = self._release()
        if refused is not None and kind is None:
            raise RuntimeError(refused)
        return False

    @contextlib.contextmanager
    def closing(self):
        """The hold for close(): granted on a refused communicator too, once
        no other thread is in it."""
        self._take(closing=True)
        try:
            yield
        finally:
            self._release()


class _CreateFailed:
    """What a rank that could not create its communicators sends its peers
    in the handle exchange (a plain object: it is pickled)."""

    def __init__(self, kind, message):
        self.kind, self.message = kind, message


class _DeviceView:
    """A non-owning __cuda_array_interface__ over a communicator's buffer that
    keeps the mapping alive (pinned) while torch holds it."""

    def __init__(self, comm, nbytes):
        ptr, self._pin = comm._pin()  # the mapping lives while this token does
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


_HOST_VIEW_TYPES = {}


def _host_view(comm, nbytes):
    """A non-owning ctypes byte array over a CPU communicator's buffer that
    keeps the mapping alive (pinned) while torch holds it (torch.frombuffer
    keeps the object it reads). The limited C API of 3.10 has no buffer
    protocol for _C's own types, hence ctypes."""
    cls = _HOST_VIEW_TYPES.get(nbytes)
    if cls is None:
        cls = _HOST_VIEW_TYPES.setdefault(nbytes, type("_HostView", (ctypes.c_ubyte * nbytes,), {}))
    ptr, token = comm._pin()
    view = cls.from_address(ptr)
    view._pin = token  # the mapping lives while the view (and so the token) does
    return view


class CommOverlap(_C.CommOverlap):
    """A userbuffers communicator.

    shape: the buffer's (full, gathered) shape, e.g. [sequence * batch, hidden];
    dtype its element type (uint8: a buffer of FP8 bytes, for the FP8 calls). One buffer per rank of tp_group, mapped into every
    peer. timeout: seconds per wait (default $TEC_COMM_TIMEOUT or 60);
    transport: "auto" (shared memory on CPU, CUDA IPC on CUDA), "shm" or
    "cuda_ipc". method ("ring_exchange", "pipeline" or "bulk", TE's names):
    every communicator runs every operation with one schedule each (ag_gemm:
    pull, gemm_rs: push, bulk_*: bulk; README, "TE's ub_cfgs"); stats()
    counts what ran by schedule name. num_splits: None, or tp_size (the split
    the pull and push schedules use); other values raise, as does any value
    with method="bulk".
    min_chunk_flops: below this many FLOPs per chunk GEMM a layer runs its
    non-overlapped path instead (a number, or {"ag": .., "rs": ..}; default
    $TEC_UB_MIN_CHUNK_FLOPS, else measured per device); stats() counts those
    calls as ag_fallback / rs_fallback.
    gemm_sm_margin: SMs the overlapped operations' chunk GEMMs leave free for
    the comm stream's kernels (default $TEC_UB_GEMM_SM_MARGIN, else 2 on CUDA;
    the CPU ignores it).
    fp8_buf: a layer's FP8 forward reduce-scatter through this communicator
    (a row layer under DelayedScaling) sends FP8 partials (gemm_rs's
    fp8_partials; TE's fp8_buf).
    Creating one is collective over tp_group.
    """

    def __init__(self, shape, dtype=torch.bfloat16, *, tp_group=None, tp_size=None, name=None, timeout=None,
                 transport="auto", device=None, method="pipeline", num_splits=None, min_chunk_flops=None,
                 gemm_sm_margin=None, fp8_buf=False, _exchange=True):
        self._lock = _OneThread()  # _serialised; exclusive()
        shape = _int_shape(shape, "shape")
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"shape must be non-empty with positive sizes, got {shape}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        if dtype not in DTYPE_CODES and dtype is not torch.uint8:
            raise TypeError(f"dtype {dtype} is not supported (float32, bfloat16, float16, or uint8 for FP8 bytes)")
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
        if device is None:  # like the layers: the current GPU where there is one
            device = ("cpu" if transport == "shm" else "cuda") if transport != "auto" else (
                "cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if transport == "auto":
            transport = "shm" if device.type == "cpu" else "cuda_ipc"
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be 'auto', 'shm' or 'cuda_ipc', got {transport!r}")
        if (device.type == "cpu") != (_TRANSPORTS[transport] == _C.TRANSPORT_SHM):
            raise ValueError(f"transport {transport!r} does not serve device {device}")
        timeout = default_timeout() if timeout is None else float(timeout)
        if not 0 < timeout <= _TIMEOUT_MAX:  # inf and nan too: every wait has a finite limit
            raise ValueError(f"timeout must be in (0, {_TIMEOUT_MAX:g}] seconds, got {timeout}")
        rank, size = _group_rank_size(tp_group, tp_size)
        num_splits = _check_num_splits(method, num_splits, size)
        if shape[0] % size:
            raise ValueError(f"the buffer's first dimension {shape[0]} is not divisible by tp_size {size}")
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.tp_group = tp_group
        self.method = method
        self.num_splits = num_splits
        self.fp8_buf = bool(fp8_buf)
        self.timeout = timeout
        self._pending = None
        self._pending_captured = False
        self._min_chunk_flops = _min_chunk_flops(min_chunk_flops, device)
        self._gemm_sm_margin = _gemm_sm_margin(gemm_sm_margin, device)
        self._fallbacks = {"ag_fallback": 0, "rs_fallback": 0}
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > _BUFFER_BYTES_MAX:
            raise ValueError(f"shape {shape} of {dtype} needs {nbytes} bytes; a communicator buffer holds at most "
                             f"{_BUFFER_BYTES_MAX} bytes")
        self.nbytes = nbytes  # the engine rounds its buffer up; checks use this
        name = name or f"comm{next(_counter)}"
        self._lock.name = name
        try:
            self._create(_TRANSPORTS[transport], device_code(device), rank, size, nbytes, name, timeout)
            ws_bytes = _C.gemm_workspace_bytes(device_code(device))
            self._gemm_ws = workspace(device, ws_bytes)  # kept alive with the communicator
            self._set_gemm(self._gemm_ws.data_ptr() if self._gemm_ws is not None else None, ws_bytes,
                           self._gemm_sm_margin)
        except Exception as e:
            self.close()
            if _exchange:  # the peers are waiting in the exchange: they learn of it and raise too
                CommOverlap._exchange([], tp_group, size=size, failed=e)
            raise
        if _exchange:
            CommOverlap._exchange([self], tp_group)

    @staticmethod
    def _exchange(comms, tp_group, size=None, failed=None):
        """Collective: exchange handles of `comms` (same order on every rank),
        map peers, and unlink names once everyone has mapped. failed: the
        exception that stopped this rank creating its communicators (it
        still takes part, so that every rank raises before anything is
        mapped, instead of the others waiting for it)."""
        size = comms[0].tp_size if comms else (size or 1)
        if failed is not None:
            mine = _CreateFailed(type(failed).__name__, str(failed))
        else:
            mine = [(c._local_handle(), c._min_chunk_flops) for c in comms]
        if size == 1:
            everyone = [mine]
        else:
            everyone = all_gather_pickled(mine, tp_group)
        if failed is not None:
            raise failed
        bad = [(r, m) for r, m in enumerate(everyone) if isinstance(m, _CreateFailed)]
        if bad:
            r, m = bad[0]
            cls = MemoryError if m.kind == "MemoryError" else RuntimeError
            raise cls(f"communicator set-up failed on rank {r} of the group: {m.kind}: {m.message}")
        error = None
        try:
            for i, c in enumerate(comms):
                for r in range(size):  # the fallback decision must be the same everywhere
                    if everyone[r][i][1] != c._min_chunk_flops:
                        raise ValueError(f"communicator '{c.name}': min_chunk_flops is {c._min_chunk_flops} on "
                                         f"this rank but {everyone[r][i][1]} on rank {r} (set "
                                         "TEC_UB_MIN_CHUNK_FLOPS or min_chunk_flops alike on every rank)")
                c._open_peers([everyone[r][i][0] for r in range(size)])
                debug.register_comm(c)  # own + peers' ranges are final now
        except Exception as e:  # every rank learns of it instead of waiting at a barrier
            error = e
        if size > 1:
            errors = all_gather_pickled(None if error is None else f"{type(error).__name__}: {error}", tp_group)
            failed = [(r, m) for r, m in enumerate(errors) if m is not None]
            if failed and error is None:
                r, m = failed[0]
                raise RuntimeError(f"communicator set-up failed on rank {r} of the group: {m}")
        if error is not None:
            raise error
        for c in comms:
            c._release_handle()

    # ---------------------------------------------------------- buffer

    def _live(self):
        if self.closed:
            self.rank  # noqa: B018 -- the engine raises EngineError naming the closed communicator

    def _stream(self):
        return stream_of(self.device)

    def _flat(self, dtype):
        """The whole buffer as a 1-D tensor of dtype. Made anew on every
        call: a view cached on the communicator would hold the communicator
        through the tensor's storage, a cycle the garbage collector cannot
        see, and a dropped communicator would never be freed."""
        if self.device.type == "cpu":
            flat = torch.frombuffer(_host_view(self, self.nbytes), dtype=torch.uint8)
        else:
            flat = torch.as_tensor(_DeviceView(self, self.nbytes), device=self.device)
        return flat.view(dtype)

    def _too_small(self, what, shape, dtype, need, have):
        return ValueError(f"communicator '{self.name}': buffer too small for the input: {what} of shape "
                          f"{tuple(shape)} ({dtype}) needs {need} bytes, the buffer has {have}")

    @_serialised
    def get_buffer(self, local_chunk=False, shape=None, dtype=None):
        """A non-owning view of the buffer ([full shape]) or of this rank's
        chunk (local_chunk=True: rows rank*S/tp.., waits until peers have read
        its previous contents, so it can be written, e.g. by a norm).
        shape/dtype reinterpret the buffer (the chunk's shape with local_chunk)."""
        self._live()
        dtype = dtype or self.dtype
        es = dtype.itemsize
        if shape is None:
            shape = list(self.shape)
            if local_chunk:
                shape[0] //= self.tp_size
        shape = _int_shape(shape, "shape")
        if any(s < 0 for s in shape):
            raise ValueError(f"communicator '{self.name}': get_buffer: shape must have sizes >= 0 (no -1: the "
                             f"view is not inferred from the buffer), got {shape}")
        numel = math.prod(shape)
        parts = self.tp_size if local_chunk else 1
        if numel * es * parts > self.nbytes:
            raise self._too_small("the local chunk" if local_chunk else "a view", shape, dtype,
                                  numel * es * parts, self.nbytes)
        flat = self._flat(dtype)
        if local_chunk:
            self._acquire(self._stream())
            return flat[self.rank * numel:(self.rank + 1) * numel].view(shape)
        return flat[:numel].view(shape)

    @_serialised
    def copy_into_buffer(self, t, local_chunk=False):
        """Copy t into this rank's chunk (local_chunk=True) or the whole buffer."""
        check_tensor(t, "tensor", device=self.device)
        view = self.get_buffer(local_chunk, shape=t.shape, dtype=t.dtype)
        if not local_chunk:
            self._acquire(self._stream())
        view.copy_(t)
        return view

    # ------------------------------------------------------- schedules

    def exclusive(self):
        """A context manager holding this communicator for the calling
        thread: a sequence of operations that belongs together (writing the
        local chunk into get_buffer() and the ag_gemm that gathers it) runs
        without another thread's operations in between. Reentrant."""
        return self._lock

    def _check_outside(self, op, t, name):
        """t must not alias any communicator buffer: the operation writes it
        while peers still read or write the buffer."""
        if self.overlaps(t):
            raise ValueError(f"communicator '{self.name}': {op}: {name} lies in a communicator buffer; it must "
                             "be memory of its own")

    def _check_mat(self, t, name, dtype=None):
        check_tensor(t, name, ndim=2, device=self.device, dtype=dtype)
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension")
        return t

    @_serialised
    def _abandon(self):
        """After an exception between a bulk *_start and its *_finish: wait
        for the comm side (errors are the caller's already) and clear the
        pending operation, so the communicator is usable again if it can be."""
        if self._pending is not None:
            try:
                (self.bulk_ag_finish if self._pending[0] == "bulk_ag" else self.bulk_rs_finish)()
            except Exception:
                pass
            self._pending = None

    def _capturing(self):
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _check_idle(self, op):
        # Operations may be captured in CUDA graphs: the handshakes' epochs
        # live in device memory and move on there (docs/architecture.md,
        # "CUDA graphs"), so replays and eager calls share a communicator.
        self._live()
        if self._pending is not None:
            raise RuntimeError(f"communicator '{self.name}': {op} while {self._pending[0]} is pending "
                               f"(call {self._pending[0]}_finish first; started by thread "
                               f"{self._pending_thread!r})")

    def _operands(self, op, a, weight, transb, bias, fp8):
        """Check a GEMM schedule's input [rows, k], weight (op(weight) is
        [k, n]) and bias [n], FP8 bytes with fp8 (an FP8Gemm); return (rows,
        k, n, the compute dtype, the engine's FP8 arguments)."""
        self._check_idle(op)
        if fp8 is not None:
            if not isinstance(fp8, FP8Gemm):
                raise TypeError(f"communicator '{self.name}': {op}: fp8 must be an FP8Gemm or None, got "
                                f"{type(fp8).__name__}")
            if not transb:
                raise ValueError(f"communicator '{self.name}': {op}: with fp8 the weight is stored [n, k] "
                                 "(transb=True; pass the weight's transpose for a dgrad)")
        byte = torch.uint8 if fp8 is not None else None
        self._check_mat(a, "input", dtype=byte)
        self._check_mat(weight, "weight", dtype=byte or a.dtype)
        rows, k = a.shape
        n, kw = weight.shape if transb else weight.shape[::-1]
        if kw != k:
            raise ValueError(f"{op}: input is [{rows}, {k}] but op(weight) is [{kw}, {n}]")
        dtype = a.dtype if fp8 is None else fp8.out_dtype
        if bias is not None:  # ag_gemm's FP8 chunk GEMMs add it: a float32 output takes a bfloat16 one
            bias_dtype = torch.bfloat16 if fp8 is not None and op == "ag_gemm" and dtype is torch.float32 else dtype
            check_tensor(bias, "bias", dtype=bias_dtype, device=self.device, shape=(n,))
        return rows, k, n, dtype, _NO_FP8 if fp8 is None else fp8.args(self.device)

    @_serialised
    def ag_gemm(self, a_local, weight, *, transb=True, bias=None, out=None, out_dtype=None, local_copy=None,
                fp8=None):
        """out[tp*rows, n] = all_gather(a_local) @ op(weight) (+ bias), the
        gather overlapped with the GEMM. a_local: this rank's [rows, k] chunk
        (a tensor, or the view get_buffer(local_chunk=True) returned: then no
        copy). weight: [n, k] with transb (fprop) or [k, n] (dgrad).
        local_copy: a [rows, k] tensor outside the buffer that receives this
        rank's chunk, copied on the comm stream off the GEMMs' path (a layer
        saves it for backward instead of cloning the buffer slot).
        Afterwards get_buffer() holds the gathered input. fp8: an FP8Gemm
        (a_local, weight and local_copy are then FP8 bytes, the weight [n,
        k]; the output is of its out_dtype, or float32)."""
        rows, k, n, dtype, fp8_args = self._operands("ag_gemm", a_local, weight, transb, bias, fp8)
        es = a_local.element_size()
        if rows * k * es * self.tp_size > self.nbytes:
            raise self._too_small("the gathered input", (rows * self.tp_size, k), a_local.dtype,
                                  rows * k * es * self.tp_size, self.nbytes)
        # Every check before the engine takes the operation's epoch: a refused
        # call leaves the communicator usable on every rank.
        if out_dtype is not None and out_dtype not in (dtype, torch.float32):
            raise ValueError(f"communicator '{self.name}': ag_gemm: out_dtype must be the input's dtype "
                             f"({dtype}) or torch.float32, got {out_dtype}")
        own_slot = self.buffer_ptr + self.rank * rows * k * es
        if self.overlaps(a_local) and a_local.data_ptr() != own_slot:
            raise ValueError(f"communicator '{self.name}': ag_gemm: a_local lies in a communicator buffer but is "
                             "not this rank's chunk (get_buffer(local_chunk=True)); the gather overwrites it")
        if local_copy is not None:
            check_tensor(local_copy, "local_copy", dtype=a_local.dtype, device=self.device, shape=(rows, k))
            if self.overlaps(local_copy):
                raise ValueError(f"communicator '{self.name}': local_copy lies in a communicator buffer; it must "
                                 "be memory of its own (it is what outlives the buffer's next use)")
        if out is None:
            out = torch.empty(rows * self.tp_size, n, dtype=out_dtype or dtype, device=self.device)
        else:
            self._check_mat(out, "out")
            if tuple(out.shape) != (rows * self.tp_size, n):
                raise ValueError(f"out has shape {tuple(out.shape)}; expected {(rows * self.tp_size, n)}")
            if out.dtype not in (dtype, torch.float32) or (out_dtype is not None and out.dtype != out_dtype):
                raise ValueError(f"communicator '{self.name}': ag_gemm: out has dtype {out.dtype}; expected "
                                 f"{out_dtype or dtype} (the input's dtype or torch.float32)")
            self._check_outside("ag_gemm", out, "out")
        self._ag_gemm(a_local.data_ptr(), rows, k, n, DTYPE_CODES[dtype], DTYPE_CODES[out.dtype],
                      weight.data_ptr(), weight.stride(0), int(transb), out.data_ptr(), out.stride(0),
                      bias.data_ptr() if bias is not None else 0,
                      local_copy.data_ptr() if local_copy is not None else 0, self._stream(), *fp8_args)
        return out

    @_serialised
    def gemm_rs(self, a, weight, *, transb=True, bias=None, out=None, fp8=None, fp8_partials=None):
        """out[S/tp, n] = reduce_scatter(a[S, k] @ op(weight)) (+ bias once),
        each peer's partial sent while the next is computed, partials summed
        in float32. fp8: an FP8Gemm (a and weight FP8 bytes, the weight [n,
        k]; partials and out of its out_dtype). fp8_partials: with fp8, an
        FP8Partials: the partials travel as FP8 bytes (out_dtype bfloat16 or
        float16)."""
        S, k, n, dtype, fp8_args = self._operands("gemm_rs", a, weight, transb, bias, fp8)
        if fp8_partials is not None:
            if not isinstance(fp8_partials, FP8Partials):
                raise TypeError(f"communicator '{self.name}': gemm_rs: fp8_partials must be an FP8Partials or None, "
                                f"got {type(fp8_partials).__name__}")
            if fp8 is None or dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"communicator '{self.name}': gemm_rs: fp8_partials needs FP8 chunk GEMMs (fp8=) "
                                 f"with out_dtype bfloat16 or float16, got {None if fp8 is None else dtype}")
        part_args = _NO_PARTIALS if fp8_partials is None else fp8_partials.args(self.device)
        es = 1 if fp8_partials is not None and self.tp_size > 1 else dtype.itemsize
        if S % self.tp_size:
            raise ValueError(f"gemm_rs: the input's {S} rows are not divisible by tp_size {self.tp_size}")
        rows = S // self.tp_size
        if S * n * es > self.nbytes:
            raise self._too_small("the GEMM output", (S, n), dtype, S * n * es, self.nbytes)
        if out is None:
            out = torch.empty(rows, n, dtype=dtype, device=self.device)
        else:
            check_tensor(out, "out", dtype=dtype, device=self.device, shape=(rows, n))
            self._check_outside("gemm_rs", out, "out")
        # one rank runs a single GEMM with the bias in its epilogue, where an FP8 GEMM's float32
        # output takes a bfloat16 bias: a float32 one is added afterwards
        late = bias if fp8 is not None and self.tp_size == 1 and dtype is torch.float32 else None
        self._gemm_rs(a.data_ptr(), a.stride(0), rows, k, n, DTYPE_CODES[dtype], weight.data_ptr(),
                      weight.stride(0), int(transb), out.data_ptr(),
                      bias.data_ptr() if bias is not None and late is None else 0, self._stream(), *fp8_args,
                      *part_args)
        if late is not None:
            out += late
        return out

    @_serialised
    def bulk_ag_start(self, t):
        """Start all-gathering this rank's chunk t ([rows, ...]; float32,
        bfloat16, float16 or uint8, e.g. FP8 bytes) into the buffer on the
        comm side; run your GEMM, then bulk_ag_finish()."""
        self._check_idle("bulk_ag_start")
        check_tensor(t, "input", device=self.device, dtype=torch.uint8 if t.dtype is torch.uint8 else None)
        if t.dim() < 1:  # before the engine starts: the gathered shape needs a first dimension
            raise ValueError(f"communicator '{self.name}': bulk_ag_start: the input must have at least one "
                             f"dimension, got a {t.dim()}-d tensor")
        nbytes = t.numel() * t.element_size()
        if nbytes * self.tp_size > self.nbytes:
            raise self._too_small("the gathered input", (t.shape[0] * self.tp_size, *t.shape[1:]), t.dtype,
                                  nbytes * self.tp_size, self.nbytes)
        self._bulk_ag_start(t.data_ptr(), nbytes, self._stream())
        self._pending_thread = threading.current_thread().name
        self._pending = ("bulk_ag", t, (t.shape[0] * self.tp_size, *t.shape[1:]), t.dtype)
        self._pending_captured = self._capturing()

    def _check_finish(self, op):
        """A bulk operation's finish is enqueued where its start was: both
        in one CUDA graph capture, or both outside."""
        if self._pending is None or self._pending[0] != op:
            raise RuntimeError(f"communicator '{self.name}': {op}_finish without {op}_start")
        if self._pending_captured != self._capturing():
            raise RuntimeError(f"communicator '{self.name}': {op}_finish "
                               f"{'outside' if self._pending_captured else 'inside'} the CUDA graph capture its "
                               f"{op}_start was {'inside' if self._pending_captured else 'outside'} of: start and "
                               "finish must be captured together")

    @_serialised
    def bulk_ag_finish(self):
        """Wait for the bulk all-gather; returns the gathered tensor as a
        non-owning view of the buffer (valid until the next use)."""
        self._check_finish("bulk_ag")
        pending, self._pending = self._pending, None  # keeps the input alive until finished
        _, _, shape, dtype = pending
        self._bulk_ag_finish(self._stream())
        numel = math.prod(shape)
        return self._flat(dtype)[:numel].view(shape)

    @_serialised
    def bulk_rs_start(self, t, out=None):
        """Start reduce-scattering t ([S, ...], not a buffer view) on the comm
        side into out ([S/tp, ...]); run your GEMM, then bulk_rs_finish()."""
        self._check_idle("bulk_rs_start")
        check_tensor(t, "input", device=self.device)
        if t.dim() < 1 or t.shape[0] % self.tp_size:
            raise ValueError(f"bulk_rs: the input's first dimension ({tuple(t.shape)}) is not divisible by "
                             f"tp_size {self.tp_size}")
        rows = t.shape[0] // self.tp_size
        cols = t.numel() // t.shape[0] if t.shape[0] else 1
        nbytes = t.numel() * t.element_size()
        if nbytes > self.nbytes:
            raise self._too_small("the reduce-scatter input", t.shape, t.dtype, nbytes, self.nbytes)
        oshape = (rows, *t.shape[1:])
        if out is None:
            out = torch.empty(oshape, dtype=t.dtype, device=self.device)
        else:
            check_tensor(out, "out", dtype=t.dtype, device=self.device, shape=oshape)
            self._check_outside("bulk_rs_start", out, "out")
        self._bulk_rs_start(t.data_ptr(), rows, cols, DTYPE_CODES[t.dtype], out.data_ptr(), self._stream())
        self._pending_thread = threading.current_thread().name
        self._pending = ("bulk_rs", t, out)
        self._pending_captured = self._capturing()

    @_serialised
    def bulk_rs_finish(self):
        """Wait for the bulk reduce-scatter; returns its output."""
        self._check_finish("bulk_rs")
        pending, self._pending = self._pending, None  # keeps the input alive until finished
        self._bulk_rs_finish(self._stream())
        return pending[2]

    @property
    def gemm_sm_margin(self):
        """SMs the overlapped operations' chunk GEMMs leave free (set at creation)."""
        return self._gemm_sm_margin

    @property
    def min_chunk_flops(self):
        """{"ag": flops, "rs": flops}: the layers' fallback thresholds. Set it
        to the same value on every rank of the group (ranks that disagree take
        different paths and time out waiting for each other)."""
        return dict(self._min_chunk_flops)

    @min_chunk_flops.setter
    def min_chunk_flops(self, value):
        self._min_chunk_flops = _min_chunk_flops(value, self.device)

    def take_overlap(self, op, rows, k, n):
        """Whether a layer should run the overlapped `op` ("ag": ag_gemm,
        "rs": gemm_rs) whose chunk GEMMs are [rows, k] @ [k, n]: False below
        min_chunk_flops, counted in stats() as a fallback. The answer depends
        on the shape and the threshold, which the ranks checked agree at
        creation, so every rank of the group takes the same path. (It issues
        no work: only the count takes the communicator's lock.)"""
        if self.pays(op, rows, k, n):
            return True
        self.count_fallback(op)
        return False

    def count_fallback(self, op):
        """Count one fallback of `op` in stats() (what take_overlap counts)."""
        with self._lock:
            self._fallbacks[_FALLBACK_KEYS[op]] += 1

    def overlaps(self, t):
        """Whether tensor t's bytes overlap this communicator's buffers (own
        region or a mapped peer's)."""
        p = t.data_ptr()
        return self._overlaps(p, p + t.numel() * t.element_size())

    def pays(self, op, rows, k, n):
        """take_overlap's answer without counting anything."""
        self._live()
        return 2.0 * rows * k * n >= self._min_chunk_flops[op]

    def stats(self):
        """Integer counters: how often each path ran (ag_overlap, rs_overlap,
        bulk_ag, bulk_rs, non_overlap, ag_fallback, rs_fallback), traffic, and
        how often each schedule ran, by its name (README, "TE's ub_cfgs"):
        "pull" (ag_gemm) and "push" (gemm_rs), in tp_size chunks whatever the
        method; bulk_ag / bulk_rs are the bulk schedules. The TE method the
        communicator was given is its `method` attribute."""
        st = super().stats()
        st.update(self._fallbacks)
        st[_SCHEDULES["ag_gemm"]] = st["ag_overlap"]
        st[_SCHEDULES["gemm_rs"]] = st["rs_overlap"]
        return st

    def close(self):
        """Release the communicator; the saved-tensor checker stops watching
        its ranges. Idempotent and thread-safe: a close() that comes after the
        first, or beside it in another thread, waits for it and does nothing.
        Closing while another thread is in an operation on the communicator
        is refused like any second thread (_OneThread)."""
        with self._lock.closer:
            if self.closed:
                return
            with self._lock.closing():
                debug.unregister_comm(self)
                super().close()

    @_serialised
    def synchronize(self):
        """Wait for this communicator's work on the current stream and its comm
        stream; raise what a wait on a peer recorded. On CUDA the waits run on
        the GPU, so a timeout or a shape mismatch is reported here or by the
        next operation on the communicator, not by the call that enqueued it."""
        self._synchronize(self._stream())

    def __repr__(self):
        if self.closed:
            return "CommOverlap(closed)"
        return (f"CommOverlap(name={self.name!r}, rank={self.rank}, tp_size={self.tp_size}, "
                f"shape={self.shape}, dtype={self.dtype}, device={self.device})")
