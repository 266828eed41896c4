"""Checked wrappers over the engine's FP8 operations (csrc/core/tec.h, FP8
section): quantize (fused amax + cast, optional transpose), amax, the
current-scaling scales, the FP8 GEMM (TN layout), and block scaling's
quantize (1x128 / 128x128 blocks) and block-scaled GEMM. FP8 data is held as
torch.uint8 storage of the OCP E4M3 / E5M2 bits; scales are float32 tensors
on the data's device, read and written by the device (no host sync)."""
import struct

import torch

from . import _C
from ._engine import DTYPE_CODES, activation_code, check_tensor, device_code, engine_device, stream_of

# torch's float8 dtypes and the engine's format codes (tec_fp8_format).
FP8_DTYPES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_code(fp8_dtype, name="fp8_dtype"):
    try:
        return FP8_DTYPES[fp8_dtype]
    except (KeyError, TypeError):
        raise TypeError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}") from None


def _scalar(t, name, device):
    """A float32 tensor of one element on device (a view is fine)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        raise TypeError(f"{name} must be a float32 tensor of one element, got "
                        f"{getattr(t, 'dtype', type(t).__name__)} of {getattr(t, 'numel', lambda: '?')()} elements")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device}")
    return t


def _check_u8(t, name, device, shape):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or not t.is_contiguous():
        raise TypeError(f"{name} must be a contiguous torch.uint8 tensor (FP8 storage)")
    if t.device != device or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} is {tuple(t.shape)} on {t.device}; expected {tuple(shape)} on {device}")
    return t


def check_fp8_gemm_shape(shape, name):
    """TE's rule for tensors entering an FP8 GEMM: the product of the
    leading dims divisible by 8, the last dim by 16."""
    shape = tuple(shape)
    lead = 1
    for d in shape[:-1]:
        lead *= d
    if not shape or lead % 8 or shape[-1] % 16:
        raise ValueError(f"FP8 execution requires the product of the leading dims of {name} to be divisible by 8 "
                         f"and its last dim by 16, got shape {shape}")


def quantize(x, fp8_dtype, scale, *, amax=None, rowwise=True, columnwise=False, out=None, out_t=None,
             scale_inv=None, dbias=None, noop=None, activation=None, activation_input=None):
    """Cast x (float32/bf16/fp16, contiguous, viewed as [rows, last dim])
    to FP8 with `scale`: data = fp8(x * scale), saturating. Returns
    (data [x's shape] or None, data_t [last dim, rows] or None, scale_inv).
    amax, if given (float32, one element, e.g. an amax-history entry),
    becomes max(amax, max |x|). out / out_t / scale_inv: preallocated outputs.
    dbias, if given (x's dtype, [last dim]), receives x's column sums (a bias
    gradient, summed in float32) from the same pass. noop, if given (float32,
    one element on x's device), is read by the device when the cast runs:
    nonzero, nothing is written (out, out_t, amax, scale_inv and dbias keep
    their contents), which lets a cast captured in a CUDA graph be switched
    off per replay (TE's noop flag).
    activation (an element-wise activation's name: gelu, relu, qgelu,
    srelu, silu) fuses it ahead of the cast: the values cast are
    activation(x), or with activation_input (x's shape and dtype: the
    activation's input) activation'(activation_input) * x, x being the
    gradient of its output; each computed in float32 and rounded to x's
    dtype, so the bytes, amax and scale_inv are those of the activation (or
    its backward) followed by the cast, without the intermediate tensor;
    dbias then sums the values before the rounding."""
    check_tensor(x, "input")
    act_mode, act, act_ptr = _fused_activation(x, activation, activation_input)
    code = fp8_code(fp8_dtype)
    _scalar(scale, "scale", x.device)
    if amax is not None:
        _scalar(amax, "amax", x.device)
    if noop is not None:
        _scalar(noop, "noop", x.device)
    if not rowwise and not columnwise and amax is None:
        raise ValueError("quantize: nothing to produce (rowwise, columnwise and amax are all off)")
    cols = x.shape[-1] if x.dim() else 1
    rows = x.numel() // cols if cols else 0
    if rowwise:
        out = torch.empty(x.shape, dtype=torch.uint8, device=x.device) if out is None else _check_u8(
            out, "out", x.device, x.shape)
    else:
        out = None
    if columnwise:
        if x.dim() < 2:
            raise ValueError(f"quantize: a columnwise (transposed) copy needs a tensor of at least 2 dims, "
                             f"got shape {tuple(x.shape)}")
        out_t = torch.empty(cols, rows, dtype=torch.uint8, device=x.device) if out_t is None else _check_u8(
            out_t, "out_t", x.device, (cols, rows))
    else:
        out_t = None
    if scale_inv is None:
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    else:
        _scalar(scale_inv, "scale_inv", x.device)
    ws, nbytes = None, 0
    if dbias is not None:
        if (not isinstance(dbias, torch.Tensor) or dbias.dtype != x.dtype or dbias.device != x.device
                or tuple(dbias.shape) != (cols,) or not dbias.is_contiguous()):
            raise ValueError(f"quantize: dbias must be a contiguous {x.dtype} tensor of shape ({cols},) on "
                             f"{x.device}, got {getattr(dbias, 'dtype', type(dbias).__name__)} of shape "
                             f"{tuple(getattr(dbias, 'shape', ()))} on {getattr(dbias, 'device', None)}")
        nbytes = _C.fp8_quantize_workspace_bytes(rows, cols)
        ws = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    _C.fp8_quantize(device_code(x.device), DTYPE_CODES[x.dtype], code, rows, cols, x.data_ptr(), scale.data_ptr(),
                    out.data_ptr() if out is not None else 0, out_t.data_ptr() if out_t is not None else 0,
                    amax.data_ptr() if amax is not None else 0, scale_inv.data_ptr(),
                    0 if dbias is None else dbias.data_ptr(), 0 if ws is None else ws.data_ptr(), nbytes,
                    0 if noop is None else noop.data_ptr(), act_mode, act, act_ptr, stream_of(x.device))
    return out, out_t, scale_inv


def _fused_activation(x, activation, activation_input):
    """quantize's (act_mode, activation code, input pointer) for the engine."""
    if activation is None:
        if activation_input is not None:
            raise ValueError("quantize: activation_input is given without an activation")
        return 0, 0, 0
    code = activation_code(activation)
    if code >= 16:
        raise ValueError(f"quantize: a fused activation must be element-wise (gelu, relu, qgelu, srelu, silu), "
                         f"got the gated {activation!r}")
    if activation_input is None:
        return 1, code, 0
    check_tensor(activation_input, "activation_input")
    if (activation_input.shape != x.shape or activation_input.dtype != x.dtype
            or activation_input.device != x.device):
        raise ValueError(f"quantize: activation_input must match x ({x.dtype}, shape {tuple(x.shape)}, on "
                         f"{x.device}), got {activation_input.dtype} of shape {tuple(activation_input.shape)} on "
                         f"{activation_input.device}")
    return 2, code, activation_input.data_ptr()


def amax(x, out=None):
    """max |x| as a float32 tensor of one element (written into `out`)."""
    check_tensor(x, "input")
    out = torch.empty(1, dtype=torch.float32, device=x.device) if out is None else _scalar(out, "out", x.device)
    _C.fp8_amax(device_code(x.device), DTYPE_CODES[x.dtype], x.numel(), x.data_ptr(), out.data_ptr(),
                stream_of(x.device))
    return out


def scale_from_amax(amax, fp8_dtype, *, power_2_scale=False, amax_epsilon=0.0, scale=None, scale_inv=None):
    """Current scaling's scales from float32 amaxes (TE's rule: amax floored
    at amax_epsilon; scale 1 for an amax of 0, inf or NaN; fp8_max / amax,
    FLT_MAX on overflow; rounded down to a power of two with
    power_2_scale). Returns (scale, scale_inv), shaped as amax."""
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or not amax.is_contiguous():
        raise TypeError("amax must be a contiguous float32 tensor")
    fp8_code(fp8_dtype)
    if not isinstance(amax_epsilon, (int, float)) or not amax_epsilon >= 0:
        raise ValueError(f"amax_epsilon must be a float >= 0, got {amax_epsilon!r}")
    scale = torch.empty_like(amax) if scale is None else scale
    scale_inv = torch.empty_like(amax) if scale_inv is None else scale_inv
    for t, name in ((scale, "scale"), (scale_inv, "scale_inv")):
        if t.dtype != torch.float32 or t.shape != amax.shape or t.device != amax.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor of amax's shape and device")
    _C.fp8_scale_from_amax(device_code(amax.device), amax.numel(), amax.data_ptr(), scale.data_ptr(),
                           scale_inv.data_ptr(), FP8_MAX[fp8_dtype], int(bool(power_2_scale)), float(amax_epsilon),
                           stream_of(amax.device))
    return scale, scale_inv


HISTORY_MAX = 8192  # TEC_FP8_HISTORY_MAX


def delayed_update(history, scale, scale_inv, fp8_max, divisor=1.0, most_recent=False):
    """Delayed scaling's update of n roles in one engine call (tec.h's
    tec_fp8_delayed_update; _fp8_meta's rule with "max" or "most_recent"
    and the default scale rule): history [len, n], scale and scale_inv [n],
    contiguous float32 tensors on one device, updated in place."""
    delayed_update_call(history, scale, scale_inv, fp8_max, divisor, most_recent)()


def delayed_update_call(history, scale, scale_inv, fp8_max, divisor=1.0, most_recent=False):
    """delayed_update's arguments checked now: a function of no arguments
    that runs the update on the current stream when called."""
    return delayed_updates_call([(history, scale, scale_inv, fp8_max, divisor, most_recent)])


def delayed_updates_call(updates):
    """delayed_update over several sets of tensors, each a tuple of
    delayed_update's arguments (history, scale, scale_inv, fp8_max, divisor,
    most_recent), all checked now: a DelayedUpdates that runs them when
    called (the per-step updates of registered fp8_meta tensors, whose
    storage never changes)."""
    per_device = {}
    for history, scale, scale_inv, fp8_max, divisor, most_recent in updates:
        length, n = history.shape
        for t, name, shape in ((history, "history", (length, n)), (scale, "scale", (n,)),
                               (scale_inv, "scale_inv", (n,))):
            if (t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape
                    or t.device != history.device):
                raise ValueError(f"delayed_update: {name} must be a contiguous float32 {shape} tensor on "
                                 f"{history.device}")
        if not 1 <= length <= HISTORY_MAX:
            raise ValueError(f"delayed_update: history length {length} is not in 1..{HISTORY_MAX}")
        per_device.setdefault(history.device, []).append(
            (history.data_ptr(), scale.data_ptr(), scale_inv.data_ptr(), length, n, int(bool(most_recent)),
             _double_bits(fp8_max), _double_bits(divisor)))
    return DelayedUpdates(tuple((d, device_code(d), _pack_records(records)) for d, records in per_device.items()),
                          tuple(u[:3] for u in updates))


def _pack_records(records):
    """fp8_delayed_updates' records as bytes of native int64s: host memory
    by construction, whatever the default device."""
    return struct.pack(f"={len(records) * len(records[0])}q", *(v for r in records for v in r))


def _double_bits(v):
    """The int64 whose bits are the IEEE double v (fp8_delayed_updates' records)."""
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


class DelayedUpdates:
    """Prepared delayed updates: per device, its engine code and the records
    of every update (fp8_delayed_updates': the addresses, lengths, flags and
    constants, as bytes), run in one engine call per device
    on the device's current stream; and the tensors whose storage the
    addresses name (held here)."""

    __slots__ = ("per_device", "tensors")

    def __init__(self, per_device, tensors):
        self.per_device, self.tensors = per_device, tensors

    def __call__(self):
        for device, code, records in self.per_device:
            _C.fp8_delayed_updates(code, records, stream_of(device))


def _gemm_operands(name, a, a_dtype, b, b_dtype):
    """The FP8 GEMMs' operand checks: 2-D contiguous uint8 data on one
    device, not both E5M2. Returns the two formats' engine codes."""
    for t, what in ((a, "A"), (b, "B")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous():
            raise TypeError(f"{what} must be a contiguous 2-D torch.uint8 tensor of FP8 data")
    if b.device != a.device:
        raise ValueError(f"B is on {b.device}; expected {a.device}")
    ca, cb = fp8_code(a_dtype, "a_dtype"), fp8_code(b_dtype, "b_dtype")
    if ca == 1 and cb == 1:
        raise ValueError(f"{name}: A and B cannot both be E5M2")
    return ca, cb


def _gemm_output(name, device, m, n, out, out_dtype, bias, accumulate):
    """The FP8 GEMMs' output [m, n]: `out` checked, or a new out_dtype
    tensor; bias (bf16, fp16 for an fp16 output) checked against it."""
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out")
        if out_dtype not in DTYPE_CODES:
            raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
        out = torch.empty(m, n, dtype=out_dtype, device=device)
    else:
        check_tensor(out, "out", device=device, shape=(m, n))
    if bias is not None:
        bias_dtype = torch.float16 if out.dtype == torch.float16 else torch.bfloat16
        check_tensor(bias, "bias", dtype=bias_dtype, device=device, shape=(n,))
        if accumulate:
            raise ValueError(f"{name}: bias with accumulate is not supported")
    return out


def fp8_gemm(a, a_scale_inv, a_dtype, b, b_scale_inv, b_dtype, *, out_dtype=torch.bfloat16, bias=None, out=None,
             accumulate=False, use_split_accumulator=True):
    """out[m, n] (+)= (a_scale_inv * A[m, k]) @ (b_scale_inv * B[n, k])^T (+ bias).

    A and B are FP8 data (uint8, contiguous, row-major, the TN layout of
    cuBLASLt) of formats a_dtype / b_dtype (not both E5M2); out is bf16,
    fp16 or fp32; bias [n] is bf16 (fp16 for an fp16 out). accumulate adds
    into `out` (e.g. an fp32 main_grad). use_split_accumulator=False is the
    fast accumulation TE uses for fprop. Shapes follow TE's FP8 rule (leading
    dims divisible by 8, last dim by 16) on every device."""
    ca, cb = _gemm_operands("fp8_gemm", a, a_dtype, b, b_dtype)
    _scalar(a_scale_inv, "a_scale_inv", a.device)
    _scalar(b_scale_inv, "b_scale_inv", a.device)
    m, k = a.shape
    n, kb = b.shape
    if k != kb:
        raise ValueError(f"fp8_gemm: A is [{m}, {k}] and B is [{n}, {kb}]; their last dims (k) must match")
    check_fp8_gemm_shape(a.shape, "A")
    check_fp8_gemm_shape(b.shape, "B")
    out = _gemm_output("fp8_gemm", a.device, m, n, out, out_dtype, bias, accumulate)
    d = engine_device(a.device)
    dev, ws, nbytes = d.code, d.ws, d.nbytes
    ld = max(k, 1)  # contiguous rows of k bytes (an empty k still needs a valid leading dimension)
    _C.fp8_gemm(dev, m, n, k, ca, cb, a.data_ptr(), ld, b.data_ptr(), ld, a_scale_inv.data_ptr(),
                b_scale_inv.data_ptr(), out.data_ptr(), n, DTYPE_CODES[out.dtype],
                bias.data_ptr() if bias is not None else 0, int(bool(accumulate)),
                0 if use_split_accumulator else 1, ws, nbytes, stream_of(a.device))
    return out


# ------------------------------------------------------ block scaling

BLOCK = 128  # TEC_FP8_BLOCK
SCALE_1D, SCALE_2D = 1, 2  # TEC_FP8_SCALE_1D / _2D


def _cdiv(a, b):
    return (a + b - 1) // b


def _round4(a):
    return (a + 3) // 4 * 4


def block_scale_shape(shape, block_dim, columnwise=False):
    """The shape of the block scale_inv of a tensor of `shape` (viewed as
    [rows, last dim]): the rowwise data's or, with columnwise, its
    transpose's; TE's Float8BlockQuantizer.get_scale_shape (the GEMM-ready
    layout of tec.h, padded to multiples of 4)."""
    shape = tuple(shape)
    cols = shape[-1] if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    if block_dim == 2:
        r, c = _cdiv(rows, BLOCK), _cdiv(cols, BLOCK)
        return (c, _round4(r)) if columnwise else (r, _round4(c))
    if block_dim != 1:
        raise ValueError(f"block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
    return (_cdiv(rows, BLOCK), _round4(cols)) if columnwise else (_cdiv(cols, BLOCK), _round4(rows))


def _check_f32(t, name, device, shape):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous():
        raise TypeError(f"{name} must be a contiguous float32 tensor")
    if t.device != device or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} is {tuple(t.shape)} on {t.device}; expected {tuple(shape)} on {device}")
    return t


def block_quantize(x, fp8_dtype, block_dim, *, rowwise=True, columnwise=False, power_2_scale=True,
                   amax_epsilon=0.0, out=None, scale_inv=None, out_t=None, scale_inv_t=None):
    """Cast x (float32/bf16/fp16, contiguous, viewed as [rows, last dim]) to
    FP8 in blocks: block_dim 1 is 1x128 (activations, gradients), 2 is
    128x128 (weights); each block's scale is fp8_max / its amax (TE's rule,
    tec.h). Returns (data [x's shape] or None, scale_inv or None, data_t
    [last dim, rows] or None, scale_inv_t or None); the scales are laid out
    as block_scale_shape says (their padding is not written: scales made
    here are zeroed first, so that equal tensors compare equal byte for
    byte)."""
    check_tensor(x, "input")
    code = fp8_code(fp8_dtype)
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
    if not rowwise and not columnwise:
        raise ValueError("block_quantize: nothing to produce (rowwise and columnwise are both off)")
    if not isinstance(amax_epsilon, (int, float)) or not amax_epsilon >= 0:
        raise ValueError(f"amax_epsilon must be a float >= 0, got {amax_epsilon!r}")
    if x.dim() < 1:
        raise ValueError("block_quantize: input must have at least 1 dim")
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    dev = x.device
    if rowwise:
        out = torch.empty(x.shape, dtype=torch.uint8, device=dev) if out is None else _check_u8(
            out, "out", dev, x.shape)
        shape = block_scale_shape(x.shape, block_dim)
        scale_inv = torch.zeros(shape, dtype=torch.float32, device=dev) if scale_inv is None else _check_f32(
            scale_inv, "scale_inv", dev, shape)
    else:
        out = scale_inv = None
    if columnwise:
        if x.dim() < 2:
            raise ValueError(f"block_quantize: a columnwise (transposed) copy needs a tensor of at least 2 dims, "
                             f"got shape {tuple(x.shape)}")
        out_t = torch.empty(cols, rows, dtype=torch.uint8, device=dev) if out_t is None else _check_u8(
            out_t, "out_t", dev, (cols, rows))
        shape = block_scale_shape(x.shape, block_dim, columnwise=True)
        scale_inv_t = torch.zeros(shape, dtype=torch.float32, device=dev) if scale_inv_t is None else _check_f32(
            scale_inv_t, "scale_inv_t", dev, shape)
    else:
        out_t = scale_inv_t = None

    def ptr(t):
        return 0 if t is None else t.data_ptr()
    _C.fp8_block_quantize(device_code(dev), DTYPE_CODES[x.dtype], code, block_dim, rows, cols, x.data_ptr(),
                          ptr(out), ptr(scale_inv), ptr(out_t), ptr(scale_inv_t), int(bool(power_2_scale)),
                          float(amax_epsilon), stream_of(dev))
    return out, scale_inv, out_t, scale_inv_t


def check_block_gemm_shape(m, n, k, a_mode, b_mode):
    """TE's rule for a block-scaled GEMM (cublaslt_gemm.cu): k a multiple of
    16, n (cuBLASLt's m) a multiple of 8, and m a multiple of 8 when A has
    1x128 scales; not both operands 128x128."""
    if a_mode not in (SCALE_1D, SCALE_2D) or b_mode not in (SCALE_1D, SCALE_2D):
        raise ValueError(f"a_block_dim and b_block_dim must be 1 or 2, got {a_mode!r} and {b_mode!r}")
    if a_mode == SCALE_2D and b_mode == SCALE_2D:
        raise ValueError("fp8_block_gemm: A and B cannot both have 128x128 blocks (1Dx1D, 1Dx2D and 2Dx1D are "
                         "supported)")
    if k % 16:
        raise ValueError(f"fp8_block_gemm: k (the inner dimension) must be a multiple of 16, got {k}")
    if n % 8:
        raise ValueError(f"fp8_block_gemm: n (B's rows) must be a multiple of 8, got {n}")
    if a_mode == SCALE_1D and m % 8:
        raise ValueError(f"fp8_block_gemm: m (A's rows) must be a multiple of 8 when A has 1x128 blocks, got {m}")


def fp8_block_gemm(a, a_scale_inv, a_block_dim, a_dtype, b, b_scale_inv, b_block_dim, b_dtype, *,
                   out_dtype=torch.bfloat16, bias=None, out=None, accumulate=False):
    """out[m, n] (+)= deq(A[m, k]) @ deq(B[n, k])^T (+ bias), where deq
    multiplies each FP8 block by its scale_inv: A and B are the rowwise data
    of block_quantize of an [m, k] and an [n, k] tensor (block_dim 1 or 2,
    not both 2) with their scale_inv. The split accumulator always (TE's
    Float8BlockScaling requires it)."""
    ca, cb = _gemm_operands("fp8_block_gemm", a, a_dtype, b, b_dtype)
    m, k = a.shape
    n, kb = b.shape
    if k != kb:
        raise ValueError(f"fp8_block_gemm: A is [{m}, {k}] and B is [{n}, {kb}]; their last dims (k) must match")
    check_block_gemm_shape(m, n, k, a_block_dim, b_block_dim)
    _check_f32(a_scale_inv, "a_scale_inv", a.device, block_scale_shape(a.shape, a_block_dim))
    _check_f32(b_scale_inv, "b_scale_inv", a.device, block_scale_shape(b.shape, b_block_dim))
    out = _gemm_output("fp8_block_gemm", a.device, m, n, out, out_dtype, bias, accumulate)
    d = engine_device(a.device)
    _C.fp8_block_gemm(d.code, m, n, k, ca, cb, a.data_ptr(), k, b.data_ptr(), k, a_scale_inv.data_ptr(),
                      b_scale_inv.data_ptr(), out.data_ptr(), n, DTYPE_CODES[out.dtype],
                      bias.data_ptr() if bias is not None else 0, int(bool(accumulate)), 0, d.ws, d.nbytes,
                      stream_of(a.device), a_block_dim, b_block_dim)
    return out
