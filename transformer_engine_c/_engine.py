"""Thin, checked wrappers over the C engine (transformer_engine_c._C).

Each function validates its tensors (device, dtype, shape, layout) with
messages that name the argument, allocates outputs and workspaces with
PyTorch, and passes addresses and the current CUDA stream to the engine.
The numerics live in C (csrc/core/cpu, csrc/core/cuda).
"""
import os

import torch

from . import _C

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CUDA_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtec_cuda.so")
_workspaces = {}


def cuda_backend_built():
    return os.path.exists(_CUDA_LIB)


def _load_cuda_backend():
    if not _C.has_cuda_backend():
        if not cuda_backend_built():
            raise RuntimeError(
                "transformer_engine_c was built without its CUDA backend (nvcc or the cuBLASLt "
                "headers were not found at build time); rebuild with TEC_CUDA=1 to see why")
        _C.load_cuda_backend(_CUDA_LIB, _gemm_policy())


def _gemm_policy():
    """The CUDA GEMM's policy bits (TEC_GEMM_* in tec.h), from the environment, read
    once when the backend loads: TEC_GEMM_TUNE=1 times cuBLASLt's candidate algorithms
    and keeps the fastest; TEC_CUDA_GEMM_EPILOGUE=0 does bias and bias gradient with
    separate kernels instead of cuBLASLt's fused epilogues."""
    tune = os.environ.get("TEC_GEMM_TUNE", "")[:1] == "1"
    unfused = os.environ.get("TEC_CUDA_GEMM_EPILOGUE", "")[:1] == "0"
    return (1 if tune else 0) | (2 if unfused else 0)


def device_code(device):
    """-1 for the CPU, the CUDA ordinal otherwise (loading the CUDA backend).
    On every engine call's path: a torch.device costs no conversion."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type == "cpu":
        return -1
    if device.type != "cuda":
        raise ValueError(f"device {device} is not supported (expected cpu or cuda)")
    if not _C.has_cuda_backend():
        _load_cuda_backend()
    return device.index if device.index is not None else torch.cuda.current_device()


# The raw current stream without building a torch.cuda.Stream object (the
# public route costs several microseconds per call, and layers call it often).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(device):
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def dtype_code(dtype, name="tensor"):
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"{name} has dtype {dtype}; expected float32, bfloat16 or float16") from None


def check_tensor(t, name, *, dtype=None, device=None, ndim=None, shape=None, contiguous=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {dtype}")
    if dtype is not torch.uint8:  # uint8 asked for by name: FP8 bytes
        dtype_code(t.dtype, name)
    if device is not None and t.device != device and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device}; expected {device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return t


def _addr(t):
    return t.data_ptr() if t is not None else 0


def workspace(device, nbytes):
    """A cached uint8 workspace of at least nbytes on device (stream-ordered
    reuse through the caching allocator's semantics: one per device)."""
    if nbytes == 0:
        return None
    key = device if type(device) is torch.device else torch.device(device)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < nbytes:
        ws = torch.empty(nbytes, dtype=torch.uint8, device=key)
        _workspaces[key] = ws
    return ws


def norm_fwd(x, gamma, beta, eps, zero_centered_gamma=False, out=None):
    """LayerNorm (beta given) or RMSNorm (beta None) over the last dim of a
    2-D x. Returns (y, mu, rsigma); mu is None for RMSNorm. `out`, if given,
    receives y (any contiguous tensor of x's shape and dtype, e.g. a view of a
    communication buffer)."""
    check_tensor(x, "input", ndim=2)
    rows, cols = x.shape
    check_tensor(gamma, "layer_norm_weight", dtype=x.dtype, device=x.device, shape=(cols,))
    if beta is not None:
        check_tensor(beta, "layer_norm_bias", dtype=x.dtype, device=x.device, shape=(cols,))
    y = torch.empty_like(x) if out is None else check_tensor(
        out, "out", dtype=x.dtype, device=x.device, shape=x.shape)
    mu = torch.empty(rows, dtype=torch.float32, device=x.device) if beta is not None else None
    rsigma = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:  # no tokens: nothing to normalise
        return y, mu, rsigma
    _C.norm_fwd(device_code(x.device), DTYPE_CODES[x.dtype], rows, cols, _addr(x), _addr(gamma),
                _addr(beta), _addr(y), _addr(mu), _addr(rsigma), float(eps),
                int(bool(zero_centered_gamma)), stream_of(x.device))
    return y, mu, rsigma


def norm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma=False, with_dbeta=True, dparams=None):
    """Backward of norm_fwd: returns (dx, dgamma, dbeta); dbeta None for RMSNorm.
    dparams, if given, is a [2, cols] ([1, cols] without dbeta) tensor that
    receives dgamma and dbeta as its rows (so both can be reduced in one
    collective); the returned dgamma/dbeta are then those rows."""
    check_tensor(x, "input", ndim=2)
    check_tensor(dy, "grad_output", dtype=x.dtype, device=x.device, shape=x.shape)
    rows, cols = x.shape
    dev = device_code(x.device)
    dx = torch.empty_like(x)
    if dparams is None:
        dgamma = torch.empty_like(gamma)
        dbeta = torch.empty_like(gamma) if with_dbeta else None
    else:
        check_tensor(dparams, "dparams", dtype=gamma.dtype, device=x.device, shape=(2 if with_dbeta else 1, cols))
        dgamma = dparams[0]
        dbeta = dparams[1] if with_dbeta else None
    if rows == 0:  # no tokens: zero parameter gradients
        dgamma.zero_()
        if dbeta is not None:
            dbeta.zero_()
        return dx, dgamma, dbeta
    nbytes = _C.norm_bwd_workspace_bytes(dev, rows, cols)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    _C.norm_bwd(dev, DTYPE_CODES[x.dtype], rows, cols, _addr(dy), _addr(x), _addr(mu),
                _addr(rsigma), _addr(gamma), _addr(dx), _addr(dgamma), _addr(dbeta),
                int(bool(zero_centered_gamma)), _addr(ws), nbytes, stream_of(x.device))
    return dx, dgamma, dbeta


def gemm(a, b, *, transa=False, transb=False, out=None, out_dtype=None, bias=None,
         bias_grad=False, accumulate=False):
    """Row-major out[m, n] (+)= op(a) @ op(b) (+ bias), float32 accumulation.

    a is [m, k] ([k, m] with transa), b is [k, n] ([n, k] with transb).
    bias_grad=True also returns the row sums of op(a) ([m], a's dtype).
    Returns out, or (out, bias_grad)."""
    check_tensor(a, "A", ndim=2)
    check_tensor(b, "B", ndim=2, dtype=a.dtype, device=a.device)
    m, k = (a.shape[1], a.shape[0]) if transa else tuple(a.shape)
    kb, n = (b.shape[1], b.shape[0]) if transb else tuple(b.shape)
    if k != kb:
        raise ValueError(f"GEMM inner dimensions differ: op(A) is [{m}, {k}], op(B) is [{kb}, {n}]")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out")
        out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    else:
        check_tensor(out, "out", device=a.device, shape=(m, n))
        if out.dtype not in (a.dtype, torch.float32):
            raise TypeError(f"out has dtype {out.dtype}; expected {a.dtype} or float32")
    if bias is not None:
        check_tensor(bias, "bias", dtype=a.dtype, device=a.device, shape=(n,))
    if m == 0 or n == 0 or k == 0:  # as torch: an empty product, zeros over an empty inner dimension
        return _empty_gemm(out, accumulate, bias, a, transa, bias_grad)
    bgrad = torch.empty(m, dtype=a.dtype, device=a.device) if bias_grad else None
    device = a.device
    d = _devices.get(device) or engine_device(device)
    dev, ws, nbytes = d.code, d.ws, d.nbytes
    # Contiguous (checked): the leading dimensions are the row lengths, whatever
    # stride a size-1 dimension reports.
    _C.gemm(dev, DTYPE_CODES[a.dtype], DTYPE_CODES[out.dtype], int(transa), int(transb), m, n, k,
            a.data_ptr(), a.shape[1], b.data_ptr(), b.shape[1], out.data_ptr(), n,
            _addr(bias), _addr(bgrad), int(bool(accumulate)), ws, nbytes, 0 if dev < 0 else stream_of(device))
    return (out, bgrad) if bias_grad else out


def _empty_gemm(out, accumulate, bias, a, transa, bias_grad):
    """gemm's result when a dimension is 0 (the engine is not called)."""
    if not accumulate:
        out.zero_()
    if bias is not None and out.numel():
        out += bias
    if not bias_grad:
        return out
    op_a = a.t() if transa else a
    return out, op_a.sum(1, dtype=torch.float32).to(a.dtype)


class Device:
    """The engine's facts about one device, found once and shared by every
    caller (the checked wrappers here and the layers' steps): the torch.device,
    the engine's device code (-1: the CPU, else the CUDA ordinal), the GEMM
    workspace (its address, bytes and tensor, kept alive here)."""

    __slots__ = ("device", "code", "ws", "nbytes", "workspace")

    def __init__(self, device):
        self.device = device
        self.code = device_code(device)
        self.nbytes = _C.gemm_workspace_bytes(self.code)
        self.workspace = workspace(device, self.nbytes)
        self.ws = self.workspace.data_ptr() if self.workspace is not None else 0

    def stream(self):
        """The raw current stream of the device (0 on the CPU)."""
        if self.code < 0:
            return 0
        return _raw_stream(self.code) if _raw_stream is not None else torch.cuda.current_stream(self.code).cuda_stream


# The one device cache: torch.device -> Device, and for CUDA devices also the
# ordinal -> the same Device (a tensor's get_device() is cheaper than its .device).
_devices = {}


def engine_device(device):
    """The Device of `device` (a torch.device with its index, or a CUDA ordinal)."""
    d = _devices.get(device)
    if d is None:
        d = Device(torch.device("cuda", device) if type(device) is int else device)
        _devices[d.device] = d
        if d.code >= 0:
            _devices[d.code] = d
    return d


# Activations (tec.h: tec_activation). TE's names; the gated ones take a
# [rows, 2 * cols] input laid out [activation half | gate half].
ACTIVATIONS = {"gelu": 0, "relu": 1, "qgelu": 2, "srelu": 3, "silu": 4, "geglu": 16, "reglu": 17,
               "qgeglu": 18, "sreglu": 19, "swiglu": 20, "clamped_swiglu": 21, "glu": 22}
GATED_ACTIVATIONS = frozenset(a for a, code in ACTIVATIONS.items() if code >= 16)


def activation_code(activation):
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation {activation!r} is not supported; expected one of "
                         f"{', '.join(sorted(ACTIVATIONS))}") from None


def _act_shape(x, code, activation):
    check_tensor(x, "input", ndim=2)
    rows, in_cols = x.shape
    if code >= 16 and in_cols % 2:
        raise ValueError(f"{activation} is gated: the input's last dimension ({in_cols}) must be even "
                         "(activation half, then gate half)")
    return rows, in_cols, in_cols // 2 if code >= 16 else in_cols


def act_fwd(x, activation, bias=None, out=None, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """act(x + bias) over a 2-D x ([rows, 2 * cols] for a gated activation,
    [rows, cols] otherwise). Returns y [rows, cols]; `out`, if given, receives it.
    limit, alpha, glu_linear_offset: clamped_swiglu only (TE's
    activation_params, TE's defaults)."""
    code = activation_code(activation)
    rows, in_cols, cols = _act_shape(x, code, activation)
    if bias is not None:
        check_tensor(bias, "bias", dtype=x.dtype, device=x.device, shape=(in_cols,))
    y = torch.empty(rows, cols, dtype=x.dtype, device=x.device) if out is None else check_tensor(
        out, "out", dtype=x.dtype, device=x.device, shape=(rows, cols))
    _C.act_fwd(device_code(x.device), code, DTYPE_CODES[x.dtype], rows, cols, _addr(x), _addr(bias),
               _addr(y), float(limit), float(alpha), float(glu_linear_offset), stream_of(x.device))
    return y


def act_bwd(dy, x, activation, dbias=False, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """Backward of act_fwd: x is the activation's input (bias included), dy
    [rows, cols]. Returns dx ([rows, in_cols]), or (dx, dbias) with dbias=True
    (dbias = column sums of dx, float32 sums)."""
    code = activation_code(activation)
    rows, in_cols, cols = _act_shape(x, code, activation)
    check_tensor(dy, "grad_output", dtype=x.dtype, device=x.device, shape=(rows, cols))
    dev = device_code(x.device)
    dx = torch.empty_like(x)
    db, ws, nbytes = None, None, 0
    if dbias:
        db = torch.empty(in_cols, dtype=x.dtype, device=x.device)
        nbytes = _C.act_bwd_workspace_bytes(dev, code, rows, cols)
        ws = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    _C.act_bwd(dev, code, DTYPE_CODES[x.dtype], rows, cols, _addr(dy), _addr(x), _addr(dx), _addr(db),
               _addr(ws), nbytes, float(limit), float(alpha), float(glu_linear_offset), stream_of(x.device))
    return (dx, db) if dbias else dx


ROPE_FORMATS = {"sbhd": 0, "bshd": 1, "thd": 2}


def _rope_int32(t, name, device):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"rope: {name} must be a 1-D tensor")
    if t.device != device:
        raise ValueError(f"rope: {name} is on {t.device}; expected {device} (the input's device)")
    return t.to(torch.int32).contiguous()


def rope(x, freqs, tensor_format, interleaved, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0,
         backward=False):
    """RoPE's apply (tec.h, tec_rope): x [s, b, h, d] / [b, s, h, d] / [t, h, d]
    in any strides, freqs [s2, 1, 1, d2] (cast to float32). Returns the
    rotated tensor, contiguous in x's shape; with backward=True x is the
    output's gradient and the result the input's. thd tokens outside every
    sequence of cu_seqlens come out zero. Positions past freqs' rows raise
    (on CUDA the positions that depend on cu_seqlens or start_positions are
    checked here, at the cost of one synchronisation)."""
    fmt = ROPE_FORMATS[tensor_format]
    dt = dtype_code(x.dtype, "t")
    if x.dim() != (3 if fmt == 2 else 4):
        raise ValueError(f"rope: t must be {3 if fmt == 2 else 4}-D in {tensor_format}, got {tuple(x.shape)}")
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    if table.dtype != torch.float32 or not table.is_contiguous() or table.device != x.device:
        table = table.to(device=x.device, dtype=torch.float32).contiguous()
    rows, d2 = table.shape
    cu = _rope_int32(cu_seqlens, "cu_seqlens", x.device)
    starts = _rope_int32(start_positions, "start_positions", x.device)
    if fmt == 2:
        s, b = x.shape[0], cu.numel() - 1
        stride_s, stride_b = x.stride(0), 0
        h, d = x.shape[1], x.shape[2]
        stride_h, stride_d = x.stride(1), x.stride(2)
        y = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    else:
        s, b = (x.shape[0], x.shape[1]) if fmt == 0 else (x.shape[1], x.shape[0])
        stride_s, stride_b = (x.stride(0), x.stride(1)) if fmt == 0 else (x.stride(1), x.stride(0))
        h, d = x.shape[2], x.shape[3]
        stride_h, stride_d = x.stride(2), x.stride(3)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.device.type == "cuda" and y.numel():
        if fmt == 2:
            top = int((torch.diff(cu) // cp_size).max()) * cp_size if b > 0 else 0  # the whole sequence's
        else:
            top = s * cp_size
        if starts is not None and starts.numel():
            top += int(starts.max())
        if top > rows:
            raise ValueError(f"rope: positions up to {top - 1} but freqs has {rows} rows")
    _C.rope(device_code(x.device), dt, fmt, int(bool(interleaved)), int(bool(backward)), s, b, h, d,
            stride_s, stride_b, stride_h, stride_d, _addr(x), _addr(y), _addr(table), rows, d2, _addr(cu),
            _addr(starts), int(cp_size), int(cp_rank), stream_of(x.device))
    return y
