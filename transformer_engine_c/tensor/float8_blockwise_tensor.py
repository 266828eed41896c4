"""TransformerEngine's block-scaled FP8 tensor and its quantizer
(Float8BlockScaling).

Float8BlockwiseQTensor looks like a tensor of its nominal dtype and holds
`_rowwise_data` (uint8 FP8 bits of the tensor's shape) with
`_rowwise_scale_inv`, and/or `_columnwise_data` (the [last dim, rows]
transpose) with `_columnwise_scale_inv`: float32 block scales in the
GEMM-ready layout of _fp8_engine.block_scale_shape (dequantized = fp8 value
* its block's scale_inv). `_is_2D_scaled` says whether the blocks are
128x128 (the columnwise data is then the transpose of the rowwise bytes) or
1x128 (the columnwise data has 128x1 blocks of the original, quantized from
the high-precision values with their own amaxes). `_fp8_dtype` and the
`_quantizer` that made it complete it. Any torch operation other than those
below runs on the dequantized values; one that writes the tensor (an
optimizer's in-place update of an FP8 primary weight) casts the result back
into its storage with its quantizer (quantized_tensor.on_values), dropping
a 128x128 tensor's columnwise copy where the quantizer makes none.

Float8BlockQuantizer makes them with the engine's block quantize
(_fp8_engine.block_quantize)."""
import copy

import torch

from .. import _fp8_engine
from .float8_tensor import _fp8_dtype
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer, on_values

__all__ = ["Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", "Float8BlockQuantizer"]

_aten = torch.ops.aten


def _block_values(data, scale_inv, block_dim, fp8_dtype):
    """data [rows, cols] (uint8) times its block scales, as float32."""
    rows, cols = data.shape
    b = _fp8_engine.BLOCK
    if block_dim == 2:
        ncb = (cols + b - 1) // b
        s = scale_inv[:, :ncb].repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]
    else:
        s = scale_inv[:, :rows].t().repeat_interleave(b, 1)[:, :cols]
    return data.view(fp8_dtype).float() * s


class Float8BlockwiseQTensorStorage(QuantizedTensorStorage):
    """TE's storage class of block-scaled FP8 data (isinstance checks)."""


class Float8BlockwiseQTensor(Float8BlockwiseQTensorStorage, QuantizedTensor):
    """A block-scaled FP8 tensor (TE's constructor keywords)."""

    @staticmethod
    def __new__(cls, *, shape, dtype, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                fp8_dtype, quantizer=None, is_2D_scaled=False, requires_grad=False, device=None):
        ref = rowwise_data if rowwise_data is not None else columnwise_data
        if ref is None:
            raise ValueError("Float8BlockwiseQTensor: needs rowwise_data or columnwise_data")
        _fp8_engine.fp8_code(fp8_dtype)
        for data, sinv, name in ((rowwise_data, rowwise_scale_inv, "rowwise"),
                                 (columnwise_data, columnwise_scale_inv, "columnwise")):
            if data is not None and (data.dtype != torch.uint8 or sinv is None or sinv.dtype != torch.float32):
                raise ValueError(f"Float8BlockwiseQTensor: {name}_data must be torch.uint8 with a float32 "
                                 f"{name}_scale_inv")
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device or ref.device,
                                                   requires_grad=requires_grad)
        self._rowwise_data, self._rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        self._columnwise_data, self._columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        self._fp8_dtype = fp8_dtype
        self._quantizer = quantizer
        self._is_2D_scaled = bool(is_2D_scaled)
        return self

    def __repr__(self, *, tensor_contents=None):
        return (f"Float8BlockwiseQTensor(fp8_dtype={self._fp8_dtype}, is_2D_scaled={self._is_2D_scaled}, "
                f"data={self.dequantize()})")

    @property
    def _block_dim(self):
        return 2 if self._is_2D_scaled else 1

    def dequantize(self, *, dtype=None):
        """The values (each FP8 byte times its block's scale_inv) as a plain
        tensor of `dtype` (the nominal dtype by default), from the rowwise
        data, else from the columnwise data."""
        dtype = dtype or self.dtype
        cols = self.shape[-1] if self.dim() else 1
        if self._rowwise_data is not None:
            vals = _block_values(self._rowwise_data.reshape(-1, cols), self._rowwise_scale_inv, self._block_dim,
                                 self._fp8_dtype)
        else:
            vals = _block_values(self._columnwise_data, self._columnwise_scale_inv, self._block_dim,
                                 self._fp8_dtype).t()
        return vals.reshape(self.shape).to(dtype)

    def _get_quantizer(self):
        return self._quantizer

    def quantize_(self, tensor, *, noop_flag=None):
        """Cast `tensor` into this tensor's storage with its quantizer (TE's name)."""
        if self._quantizer is None:
            raise RuntimeError("Float8BlockwiseQTensor.quantize_: the tensor has no quantizer to cast with")
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def storage_bytes(self):
        """Bytes this tensor holds: its FP8 copies and their scales."""
        return sum(t.numel() * t.element_size() for t in (self._rowwise_data, self._rowwise_scale_inv,
                                                          self._columnwise_data, self._columnwise_scale_inv)
                   if t is not None)

    def __reduce_ex__(self, protocol):
        return _make_in_reduce_ex, (self.shape, self.dtype, self._rowwise_data, self._rowwise_scale_inv,
                                    self._columnwise_data, self._columnwise_scale_inv, self._fp8_dtype,
                                    self._is_2D_scaled)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = self._with(torch.clone)
        new._quantizer = copy.deepcopy(self._quantizer, memo)
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in new.__dict__:
                setattr(new, k, copy.deepcopy(v, memo))
        return new

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        """Drop the copies a later use does not need (TE's usage flags). A
        missing 128x128 columnwise copy is made from the rowwise bytes; a
        1x128 one cannot be (it has its own blocks), so asking for it raises."""
        if columnwise_usage and self._columnwise_data is None:
            if not self._is_2D_scaled or self._rowwise_data is None:
                raise RuntimeError("Float8BlockwiseQTensor: the columnwise copy of 1x128 blocks cannot be made from "
                                   "the rowwise data; quantize with columnwise usage")
            self._columnwise_data = self._rowwise_data.reshape(-1, self.shape[-1]).t().contiguous()
            self._columnwise_scale_inv = _transposed_grid(self._rowwise_scale_inv, self.shape)
        if rowwise_usage and self._rowwise_data is None:
            raise RuntimeError("Float8BlockwiseQTensor: the rowwise data was dropped")
        if rowwise_usage is False and self._columnwise_data is not None:
            self._rowwise_data = self._rowwise_scale_inv = None
        if columnwise_usage is False and self._rowwise_data is not None:
            self._columnwise_data = self._columnwise_scale_inv = None

    # ---- saving for backward (the protocol of csrc/python/saving.c and TE)

    def prepare_for_saving(self):
        """(tensors to save, self): the storage is handed to autograd and
        dropped here until restore_from_saved puts it back."""
        tensors = [self._rowwise_data, self._columnwise_data, self._rowwise_scale_inv, self._columnwise_scale_inv]
        self._rowwise_data = self._columnwise_data = self._rowwise_scale_inv = self._columnwise_scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        """Take back the first four saved tensors; return the rest."""
        (self._rowwise_data, self._columnwise_data, self._rowwise_scale_inv,
         self._columnwise_scale_inv) = tensors[:4]
        return tensors[4:]

    # ---- torch integration

    def _with(self, fn):
        def f(t):
            return None if t is None else fn(t)
        return Float8BlockwiseQTensor(shape=self.shape, dtype=self.dtype, rowwise_data=f(self._rowwise_data),
                                      rowwise_scale_inv=f(self._rowwise_scale_inv),
                                      columnwise_data=f(self._columnwise_data),
                                      columnwise_scale_inv=f(self._columnwise_scale_inv), fp8_dtype=self._fp8_dtype,
                                      quantizer=self._quantizer, is_2D_scaled=self._is_2D_scaled,
                                      device=self.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            return args[0]._with(lambda t: t)
        if func is _aten.clone.default:
            return args[0]._with(torch.clone)
        if func is _aten.copy_.default and isinstance(args[0], Float8BlockwiseQTensor):
            dst, src = args[0], args[1]
            if (isinstance(src, Float8BlockwiseQTensor) and src._fp8_dtype == dst._fp8_dtype
                    and src._is_2D_scaled == dst._is_2D_scaled and src.shape == dst.shape
                    and src._rowwise_data is not None and dst._rowwise_data is not None):  # bytes and scales
                dst._rowwise_data.copy_(src._rowwise_data)
                dst._rowwise_scale_inv.copy_(src._rowwise_scale_inv)
                if dst._columnwise_data is not None:
                    if src._columnwise_data is None:
                        dst._columnwise_data = dst._columnwise_scale_inv = None
                    else:
                        dst._columnwise_data.copy_(src._columnwise_data)
                        dst._columnwise_scale_inv.copy_(src._columnwise_scale_inv)
                return dst
            if dst._quantizer is None:
                raise RuntimeError("Float8BlockwiseQTensor.copy_: the destination has no quantizer to cast with")
            dst._quantizer.update_quantized(src.dequantize() if isinstance(src, QuantizedTensor)
                                            else src.expand(dst.shape), dst)
            return dst
        if func is _aten._to_copy.default and isinstance(args[0], Float8BlockwiseQTensor):  # .float(): values
            t = args[0]
            vals = t.dequantize(dtype=kwargs.get("dtype") or t.dtype)
            rest = {k: v for k, v in kwargs.items() if k in ("device", "layout", "pin_memory", "memory_format")}
            return _aten._to_copy.default(vals, **rest) if rest else vals
        return on_values(func, args, kwargs)


def _make_in_reduce_ex(shape, dtype, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                       fp8_dtype, is_2D_scaled):
    """Unpickle a Float8BlockwiseQTensor (without its quantizer)."""
    return Float8BlockwiseQTensor(shape=shape, dtype=dtype, rowwise_data=rowwise_data,
                                  rowwise_scale_inv=rowwise_scale_inv, columnwise_data=columnwise_data,
                                  columnwise_scale_inv=columnwise_scale_inv, fp8_dtype=fp8_dtype,
                                  is_2D_scaled=is_2D_scaled)


def _transposed_grid(scale_inv, shape):
    """The 128x128 scales of the transpose: the grid of scale_inv transposed
    (both padded as block_scale_shape says)."""
    rs, cs = _fp8_engine.block_scale_shape(shape, 2), _fp8_engine.block_scale_shape(shape, 2, columnwise=True)
    out = torch.zeros(cs, dtype=torch.float32, device=scale_inv.device)
    out[:, :rs[0]] = scale_inv[:, :cs[0]].t()
    return out


class Float8BlockQuantizer(Quantizer):
    """Block scaling's quantizer (TE's keywords): block_scaling_dim 1 for
    1x128 blocks (activations, gradients), 2 for 128x128 (weights); each
    block's scale is fp8_max / its amax (floored at amax_epsilon), rounded
    down to a power of two with force_pow_2_scales. rowwise / columnwise:
    which copies a quantize makes."""

    def __init__(self, fp8_dtype, *, rowwise, columnwise, amax_epsilon=0.0, force_pow_2_scales=True,
                 block_scaling_dim=2):
        fp8_dtype = _fp8_dtype(fp8_dtype)
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"Float8BlockQuantizer: block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
        if not isinstance(amax_epsilon, (int, float)) or not amax_epsilon >= 0:
            raise ValueError(f"Float8BlockQuantizer: amax_epsilon must be >= 0, got {amax_epsilon!r}")
        self.dtype = fp8_dtype
        self.rowwise_usage, self.columnwise_usage = bool(rowwise), bool(columnwise)
        self.amax_epsilon = float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.block_scaling_dim = block_scaling_dim
        self.block_len = _fp8_engine.BLOCK
        self.internal = False

    def copy(self):
        q = Float8BlockQuantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                                 amax_epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales,
                                 block_scaling_dim=self.block_scaling_dim)
        q.internal = self.internal
        return q

    def set_usage(self, *, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def get_scale_shape(self, shape, columnwise):
        return _fp8_engine.block_scale_shape(shape, self.block_scaling_dim, columnwise)

    def get_columnwise_shape(self, shape):
        shape = tuple(shape)
        return (shape[-1],) + shape[:-1] if shape else ()

    def is_quantizable(self, inp):
        """TE's rule for an FP8 all-gather: 2+ dims, both the last dim and the
        product of the others multiples of 128."""
        rows = 1
        for d in inp.shape[:-1]:
            rows *= d
        return inp.dim() >= 2 and inp.shape[-1] % self.block_len == 0 and rows % self.block_len == 0

    def __call__(self, tensor):
        return self.quantize(tensor)

    def _cast(self, x, dst=None):
        columnwise = self.columnwise_usage and x.dim() >= 2
        kw = {}
        if dst is not None:
            kw = dict(out=dst._rowwise_data if self.rowwise_usage else None,
                      scale_inv=dst._rowwise_scale_inv if self.rowwise_usage else None,
                      out_t=dst._columnwise_data if columnwise else None,
                      scale_inv_t=dst._columnwise_scale_inv if columnwise else None)
        return _fp8_engine.block_quantize(x, self.dtype, self.block_scaling_dim, rowwise=self.rowwise_usage,
                                          columnwise=columnwise, power_2_scale=self.force_pow_2_scales,
                                          amax_epsilon=self.amax_epsilon, **kw)

    def quantize(self, tensor, *, out=None):
        """A Float8BlockwiseQTensor of `tensor` (or `tensor` cast into `out`)."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Float8BlockQuantizer: expected a tensor, got {type(tensor).__name__}")
        x = tensor.detach().contiguous()
        data, sinv, data_t, sinv_t = self._cast(x)
        return Float8BlockwiseQTensor(shape=x.shape, dtype=x.dtype, rowwise_data=data, rowwise_scale_inv=sinv,
                                      columnwise_data=data_t, columnwise_scale_inv=sinv_t, fp8_dtype=self.dtype,
                                      quantizer=self, is_2D_scaled=self.block_scaling_dim == 2, device=x.device)

    def update_quantized(self, src, dst, *, noop_flag=None):
        """Cast src into dst's storage (same shape); its scales are refreshed."""
        if noop_flag is not None:
            raise NotImplementedError("Float8BlockQuantizer.update_quantized: noop_flag is not supported")
        if not isinstance(dst, Float8BlockwiseQTensor) or tuple(src.shape) != tuple(dst.shape):
            raise ValueError("Float8BlockQuantizer.update_quantized: dst must be a Float8BlockwiseQTensor of src's "
                             "shape")
        x = src.detach().to(dst.device).contiguous()
        (dst._rowwise_data, dst._rowwise_scale_inv, dst._columnwise_data,
         dst._columnwise_scale_inv) = self._cast(x, dst)
        dst._fp8_dtype = self.dtype
        dst._is_2D_scaled = self.block_scaling_dim == 2
        return dst

    def make_empty(self, shape, *, dtype=torch.float32, device=None, requires_grad=False):
        """An uninitialised Float8BlockwiseQTensor of `shape` (storage allocated)."""
        device = torch.device(device if device is not None else "cpu")
        shape = tuple(shape)

        def alloc(s, dt):
            return torch.empty(s, dtype=dt, device=device)
        row = self.rowwise_usage
        col = self.columnwise_usage and len(shape) >= 2
        return Float8BlockwiseQTensor(
            shape=shape, dtype=dtype, rowwise_data=alloc(shape, torch.uint8) if row else None,
            rowwise_scale_inv=alloc(self.get_scale_shape(shape, False), torch.float32) if row else None,
            columnwise_data=alloc(self.get_columnwise_shape(shape), torch.uint8) if col else None,
            columnwise_scale_inv=alloc(self.get_scale_shape(shape, True), torch.float32) if col else None,
            fp8_dtype=self.dtype, quantizer=self, is_2D_scaled=self.block_scaling_dim == 2,
            requires_grad=requires_grad, device=device)
