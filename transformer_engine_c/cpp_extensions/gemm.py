"""`general_gemm` with TransformerEngine's signature and column-major
layouts, on the engine's GEMMs: bf16 / fp16 / fp32 operands through
_engine.gemm, Float8Tensor operands through _fp8_engine.fp8_gemm.
tests/test_te_api.py checks it against a float64 reference.

TE names the operands as cuBLAS sees them: with layout "XY" (X for A, Y for
B; "T" transposed), the row-major result is op(B) @ op(A), where op(A) is
A^T for "T" and A for "N", and likewise for B:

  "TN"  out = B @ A^T    fprop  (A the weight [n, k], B the input [..., k])
  "NN"  out = B @ A      dgrad  (A the weight [k, n], B dY [..., k])
  "NT"  out = B^T @ A    wgrad  (A the input [rows, n], B dY [rows, k])

Leading dimensions are flattened; without a transposed B the output keeps
B's leading dimensions, as TE's does."""
import torch

from .. import _engine, _fp8_engine
from ..tensor.float8_tensor import Float8TensorStorage
from ..tensor.quantized_tensor import QuantizedTensorStorage, Quantizer

__all__ = ["general_gemm"]

_LAYOUTS = ("TN", "NN", "NT")
_HIGH = (torch.float32, torch.bfloat16, torch.float16)


def _unsupported(name, what):
    return NotImplementedError(f"general_gemm: {name}={what} is not supported by {__package__.split('.')[0]}")


def _dims2(shape):
    """A shape as TE's GEMM sees it: [product of the leading dims, last dim]."""
    if len(shape) == 0:
        return 1, 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


def _kind(t, name):
    """'fp8' for a Float8Tensor, 'high' for a bf16 / fp16 / fp32 tensor;
    anything else raises naming the argument."""
    if isinstance(t, Float8TensorStorage):
        return "fp8"
    if isinstance(t, QuantizedTensorStorage):
        raise NotImplementedError(f"general_gemm: {name} is a {type(t).__name__}; the operands must be bf16, fp16 "
                                  "or fp32 tensors, or Float8Tensors (per-tensor scales)")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"general_gemm: {name} must be a torch.Tensor or a Float8Tensor, got {type(t).__name__}")
    if t.dtype not in _HIGH:
        raise TypeError(f"general_gemm: {name} has dtype {t.dtype}; expected float32, bfloat16, float16 or a "
                        "Float8Tensor")
    return "high"


def _fp8_rows(t, name, transposed):
    """t's FP8 bytes as the engine's FP8 GEMM reads an operand, [rows, k]
    row-major: its data viewed 2-D, or (transposed) its [last dim, rows]
    transpose; and its scale_inv."""
    if t._scale_inv is None:
        raise ValueError(f"general_gemm: {name} holds no FP8 data (a Float8Tensor saved for backward?)")
    if transposed:
        data = t.get_transpose() if t._data is not None else t._transpose
    elif t._data is not None:
        data = t._data.reshape(_dims2(t._data.shape))
    else:
        data = t._transpose.t()
    if data is None:
        raise ValueError(f"general_gemm: {name} holds no FP8 data")
    return data.contiguous(), t._scale_inv


def _check_scales(alpha, beta, accumulate):
    if alpha is None or float(alpha) != 1.0:
        raise _unsupported("alpha", repr(alpha))
    if not accumulate:
        if beta not in (None, 0.0):
            raise ValueError(f"general_gemm: beta={beta!r} needs accumulate=True (without it the output is "
                             "not read, so beta must be None or 0)")
    elif beta is not None and float(beta) != 1.0:
        raise _unsupported("beta", repr(beta))


def general_gemm(A, B, out_dtype=None, quantization_params=None, gelu=False, gelu_in=None, alpha=1.0, beta=None,
                 accumulate=False, layout="TN", out=None, bias=None, use_split_accumulator=False, grad=False,
                 ub=None, ub_type=None, extra_output=None, bulk_overlap=False):
    """TE's general_gemm: op(B) @ op(A) by `layout` (module docstring),
    into `out` when given (added to it with accumulate=True), in out_dtype
    (A's dtype by default for bf16 / fp16 / fp32 operands; FP8 operands need
    out_dtype or out), plus `bias` along the last dim, then cast by
    `quantization_params` (a quantizer of this package) when given. With
    grad=True and bias given (layout "NT", wgrad) the bias is not added:
    its gradient, B's column sums, is returned instead.

    Returns (out, bias_grad, gelu_input, extra_output), as TE's; the last
    two are None. Not supported, each raising NotImplementedError naming
    the argument: gelu, alpha other than 1, beta other than 1 with
    accumulate, ub / ub_type / extra_output / bulk_overlap (userbuffers
    overlap runs through CommOverlap and the layers), Float8Blockwise
    operands, a quantized `out`."""
    if layout not in _LAYOUTS:
        raise ValueError(f"general_gemm: layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}")
    if gelu or gelu_in is not None:
        raise _unsupported("gelu" if gelu else "gelu_in", "given (the GELU epilogue)")
    for name, value in (("ub", ub), ("ub_type", ub_type), ("extra_output", extra_output)):
        if value is not None:
            raise _unsupported(name, "given (comm+GEMM overlap)")
    if bulk_overlap:
        raise _unsupported("bulk_overlap", "True")
    _check_scales(alpha, beta, accumulate)
    if quantization_params is not None and not isinstance(quantization_params, Quantizer):
        raise TypeError(f"general_gemm: quantization_params must be a quantizer of this package, got "
                        f"{type(quantization_params).__name__}")
    if out is not None:
        if isinstance(out, QuantizedTensorStorage) or quantization_params is not None:
            raise _unsupported("out", "with a quantized output")
        if not isinstance(out, torch.Tensor) or not out.is_contiguous():
            raise ValueError("general_gemm: out must be a contiguous torch.Tensor")
    elif accumulate:
        raise ValueError("general_gemm: accumulate=True needs out")
    if out_dtype is not None and out_dtype not in _HIGH:
        raise _unsupported("out_dtype", str(out_dtype))

    transa, transb = layout[0] == "T", layout[1] == "T"
    kind_a, kind_b = _kind(A, "A"), _kind(B, "B")
    if kind_a != kind_b:
        what = {"fp8": "a Float8Tensor", "high": "not FP8"}
        raise TypeError(f"general_gemm: A is {what[kind_a]} and B is {what[kind_b]}; both operands must be "
                        "Float8Tensors or neither")
    a0, a1 = _dims2(A.shape)
    b0, b1 = _dims2(B.shape)
    n, k = (a0, a1) if transa else (a1, a0)
    m, kb = (b1, b0) if transb else (b0, b1)
    if k != kb:
        raise ValueError(f"general_gemm: A {tuple(A.shape)} and B {tuple(B.shape)} do not multiply in layout "
                         f"{layout} (op(B) is [{m}, {kb}], op(A) is [{k}, {n}])")
    shape = (m, n) if transb else (*B.shape[:-1], n)
    bias_grad = grad and bias is not None
    if bias_grad and layout != "NT":
        raise _unsupported("bias", f"with grad=True in layout {layout} (its gradient is computed for NT)")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"general_gemm: bias must be a tensor, got {type(bias).__name__}")
    if out is not None and tuple(out.shape) != tuple(shape):
        raise ValueError(f"general_gemm: out has shape {tuple(out.shape)}; expected {shape}")
    out2 = out.view(m, n) if out is not None else None

    if kind_a == "high":
        if B.dtype != A.dtype:
            raise TypeError(f"general_gemm: B has dtype {B.dtype}; expected A's, {A.dtype}")
        dtype = out.dtype if out is not None else (out_dtype or A.dtype)
        if dtype not in (A.dtype, torch.float32):
            raise _unsupported("out_dtype", f"{dtype} with {A.dtype} operands (their dtype or float32 is)")
        # the engine's out[m, n] = op(a) @ op(b): a is B, b is A
        res = _engine.gemm(B.reshape(b0, b1).contiguous(), A.reshape(a0, a1).contiguous(), transa=transb,
                           transb=transa, out=out2, out_dtype=dtype, bias=None if bias_grad else bias,
                           bias_grad=bias_grad, accumulate=accumulate)
        result, dbias = res if bias_grad else (res, None)
    else:
        if bias_grad:
            raise _unsupported("bias", "with grad=True and FP8 operands")
        dtype = out.dtype if out is not None else out_dtype
        if dtype is None:
            raise ValueError("general_gemm: FP8 operands need out_dtype (or out)")
        # the engine's FP8 GEMM is out[m, n] = a[m, k] @ b[n, k]^T: a is op(B), b is op(A)^T
        a, a_sinv = _fp8_rows(B, "B", transb)
        b, b_sinv = _fp8_rows(A, "A", not transa)
        result = _fp8_engine.fp8_gemm(a, a_sinv, B._fp8_dtype, b, b_sinv, A._fp8_dtype, out_dtype=dtype,
                                      bias=bias, out=out2, accumulate=accumulate,
                                      use_split_accumulator=use_split_accumulator)
        dbias = None
    result = out if out is not None else result.view(shape)
    if quantization_params is not None:
        result = quantization_params(result)
    return result, dbias, None, None
