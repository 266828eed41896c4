"""TransformerEngine's per-tensor FP8 tensor and its quantizers.

Float8Tensor is a torch.Tensor subclass that looks like a tensor of its
nominal dtype (bf16, fp32...) and holds `_data` (uint8 storage of the FP8
bits), `_scale_inv` (float32, one element: dequantized = fp8 value *
scale_inv), `_fp8_dtype` (torch.float8_e4m3fn or torch.float8_e5m2), an
optional `_transpose` ([last dim, rows] of the same bits, what the
backward GEMMs read) and the `_quantizer` that made it. Any torch operation
on it other than those below runs on the dequantized values.

Float8Quantizer (delayed scaling: the scale is given, e.g. a view of an
fp8_meta's scale, and the amax is max-ed into a given tensor, e.g. the
current row of an amax history) and Float8CurrentScalingQuantizer (the
scale comes from this tensor's own amax, optionally all-reduced over a
group) produce them; Float8ParamQuantizer is delayed scaling's for an FP8
primary weight (its scale read from the owning layer's fp8_meta). The casts
are the engine's (_fp8_engine.py).

As a parameter (FP8 primary weights, quantization.quantized_model_init) a
Float8Tensor follows TE's rules: in-place torch operations (an optimizer's
add_, addcdiv_, copy_, mul_...) dequantize, compute and quantize back into
the same `_data` and `_scale_inv` with the tensor's quantizer (its scale
policy decides the new scale) and drop the cached transpose; detach / alias
and view / reshape share the bytes, clone copies them, copy_ from another
Float8Tensor of the same format copies bytes and scale; everything else
(`.float()`, `.to(dtype)`, arithmetic) returns plain dequantized tensors."""
import copy
import weakref

import torch

from .. import _fp8_engine
from ..constants import DType
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer, on_values

__all__ = ["Float8Tensor", "Float8TensorStorage", "Float8Quantizer", "Float8CurrentScalingQuantizer",
           "Float8ParamQuantizer"]

_aten = torch.ops.aten


def _fp8_dtype(fp8_dtype):
    """torch's float8 dtype of `fp8_dtype`, given as one or as TE's DType."""
    if isinstance(fp8_dtype, DType):
        fp8_dtype = fp8_dtype.torch_dtype()
    _fp8_engine.fp8_code(fp8_dtype)
    return fp8_dtype


def _make_in_reduce_ex(data, fp8_scale_inv, fp8_dtype, dtype, shape, data_transpose):
    """Unpickle a Float8Tensor (its quantizer is not saved: a loaded tensor
    casts into a parameter with load_state_dict, which copies the bytes)."""
    return Float8Tensor(shape=shape, dtype=dtype, data=data, fp8_scale_inv=fp8_scale_inv, fp8_dtype=fp8_dtype,
                        data_transpose=data_transpose)


class Float8TensorStorage(QuantizedTensorStorage):
    """TE's storage class of per-tensor FP8 data (isinstance checks)."""


class Float8Tensor(Float8TensorStorage, QuantizedTensor):
    """An FP8 tensor with one scale (TE's constructor keywords)."""

    @staticmethod
    def __new__(cls, *, shape, dtype, data, fp8_scale_inv, fp8_dtype, data_transpose=None, quantizer=None,
                requires_grad=False, device=None):
        if data is not None and (data.dtype != torch.uint8 or tuple(data.shape) != tuple(shape)):
            raise ValueError(f"Float8Tensor: data must be torch.uint8 of shape {tuple(shape)}, got "
                             f"{data.dtype} {tuple(data.shape)}")
        if not isinstance(fp8_scale_inv, torch.Tensor) or fp8_scale_inv.dtype != torch.float32 \
                or fp8_scale_inv.numel() != 1:
            raise ValueError("Float8Tensor: fp8_scale_inv must be a float32 tensor of one element")
        ref = data if data is not None else data_transpose
        if ref is None:
            raise ValueError("Float8Tensor: needs data or data_transpose")
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device or ref.device,
                                                   requires_grad=requires_grad)
        self._data = data
        self._transpose = data_transpose
        self._transpose_invalid = data_transpose is None
        self._scale_inv = fp8_scale_inv
        self._fp8_dtype = _fp8_dtype(fp8_dtype)
        self._quantizer = quantizer
        return self

    def __repr__(self, *, tensor_contents=None):
        return (f"Float8Tensor(fp8_dtype={self._fp8_dtype}, scale_inv={self._scale_inv.item()}, "
                f"data={self.dequantize(dtype=self.dtype)})")

    # ---- values

    def dequantize(self, *, dtype=None):
        """The values (fp8 * scale_inv) as a plain tensor of `dtype` (the
        nominal dtype by default)."""
        dtype = dtype or self.dtype
        if self._data is not None:
            vals = self._data.view(self._fp8_dtype).float()
        else:  # only the transpose is kept
            vals = self._transpose.view(self._fp8_dtype).float().t().reshape(self.shape)
        return (vals * self._scale_inv).to(dtype)

    def _get_quantizer(self):
        return self._quantizer

    def quantize_(self, tensor, *, noop_flag=None):
        """Cast `tensor` into this tensor's storage with its quantizer (TE's
        name): the new bytes and scale_inv, the transpose dropped or remade
        as the quantizer's usage says."""
        if self._quantizer is None:
            raise RuntimeError("Float8Tensor.quantize_: the tensor has no quantizer to cast with")
        if isinstance(tensor, Float8Tensor):
            tensor = tensor.dequantize()
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def _reset_caches(self):
        """Drop the cached transpose (TE's name; Megatron calls it after
        writing the bytes directly)."""
        self._transpose, self._transpose_invalid = None, True

    def storage_bytes(self):
        """Bytes this tensor holds: the FP8 data, its transpose when kept,
        and the scale_inv."""
        return sum(t.numel() * t.element_size() for t in (self._data, self._transpose, self._scale_inv)
                   if t is not None)

    def __deepcopy__(self, memo):
        """A copy of the bytes, the scale and the attributes (a deep-copied
        module's weights quantize with the copy's fp8_meta)."""
        if id(self) in memo:
            return memo[id(self)]

        def dup(t):
            return None if t is None else t.clone()
        new = Float8Tensor(shape=self.shape, dtype=self.dtype, data=dup(self._data), fp8_scale_inv=dup(self._scale_inv),
                           fp8_dtype=self._fp8_dtype, data_transpose=None if self._transpose_invalid else dup(
                               self._transpose), quantizer=copy.deepcopy(self._quantizer, memo),
                           requires_grad=self.requires_grad, device=self.device)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in new.__dict__:
                setattr(new, k, copy.deepcopy(v, memo))
        return new

    def __reduce_ex__(self, protocol):
        return _make_in_reduce_ex, (self._data, self._scale_inv, self._fp8_dtype, self.dtype, tuple(self.shape),
                                    None if self._transpose_invalid else self._transpose)

    def get_transpose(self):
        """The [last dim, rows] FP8 bits, made from the rowwise data if
        needed (a byte transpose: the same values)."""
        if self._transpose is None or self._transpose_invalid:
            flat = self._data.reshape(-1, self._data.shape[-1])
            self._transpose = flat.t().contiguous()
            self._transpose_invalid = False
        return self._transpose

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        """Keep only the copies a later use needs (TE's usage flags)."""
        if columnwise_usage:
            self.get_transpose()
        if rowwise_usage is False and self._transpose is not None and not self._transpose_invalid:
            self._data = None
        if columnwise_usage is False:
            self._transpose, self._transpose_invalid = None, True

    # ---- saving for backward (the protocol of csrc/python/saving.c and TE)

    def prepare_for_saving(self):
        """(tensors to save, self): the storage is handed to autograd and
        dropped here until restore_from_saved puts it back."""
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = None
        self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        """Take back the first three saved tensors; return the rest (TE's
        convention)."""
        self._data, self._transpose, self._scale_inv = tensors[0], tensors[1], tensors[2]
        self._transpose_invalid = self._transpose is None
        return tensors[3:]

    # ---- torch integration

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            t = args[0]
            return Float8Tensor(shape=t.shape, dtype=t.dtype, data=t._data, fp8_scale_inv=t._scale_inv,
                                fp8_dtype=t._fp8_dtype, data_transpose=t._transpose, quantizer=t._quantizer,
                                device=t.device)
        if func is _aten.clone.default:
            t = args[0]
            return Float8Tensor(shape=t.shape, dtype=t.dtype, data=None if t._data is None else t._data.clone(),
                                fp8_scale_inv=t._scale_inv.clone(), fp8_dtype=t._fp8_dtype,
                                data_transpose=None if t._transpose is None else t._transpose.clone(),
                                quantizer=t._quantizer, device=t.device)
        if func is _aten.copy_.default and isinstance(args[0], Float8Tensor):
            dst, src = args[0], args[1]
            if (isinstance(src, Float8Tensor) and src._fp8_dtype == dst._fp8_dtype and src._data is not None
                    and dst._data is not None and src.shape == dst.shape):  # the bytes and the scale, as TE
                dst._data.copy_(src._data)
                dst._scale_inv.copy_(src._scale_inv)
                dst._transpose, dst._transpose_invalid = None, True
                return dst
            if dst._quantizer is None:
                raise RuntimeError("Float8Tensor.copy_: the destination has no quantizer to cast with")
            dst.quantize_(src if isinstance(src, Float8Tensor) else src.expand(dst.shape))
            return dst
        if func is _aten._to_copy.default and isinstance(args[0], Float8Tensor):  # .to(dtype), .float(): values
            t = args[0]
            vals = t.dequantize(dtype=kwargs.get("dtype") or t.dtype)
            rest = {k: v for k, v in kwargs.items() if k in ("device", "layout", "pin_memory", "memory_format")}
            return _aten._to_copy.default(vals, **rest) if rest else vals
        if func in (_aten.view.default, _aten._unsafe_view.default) and args[0]._data is not None:
            t = args[0]
            data = t._data.view(args[1])
            keep_t = tuple(data.shape[-1:]) == tuple(t.shape[-1:]) and not t._transpose_invalid
            return Float8Tensor(shape=data.shape, dtype=t.dtype, data=data, fp8_scale_inv=t._scale_inv,
                                fp8_dtype=t._fp8_dtype, data_transpose=t._transpose if keep_t else None,
                                quantizer=t._quantizer, device=t.device)

        return on_values(func, args, kwargs)


class _Quantizer(Quantizer):
    """What the two quantizers share: TE's usage flags and call forms."""

    def __init__(self, fp8_dtype, rowwise, columnwise):
        self.dtype = _fp8_dtype(fp8_dtype)
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.internal = False

    def set_usage(self, *, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def __call__(self, tensor):
        return self.quantize(tensor)

    def quantize(self, tensor, *, out=None):
        """A Float8Tensor of `tensor` (or `tensor` cast into `out`)."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: expected a tensor, got {type(tensor).__name__}")
        x = tensor.detach().contiguous()
        data, data_t, scale_inv = self._cast(x, None, None, None)
        return Float8Tensor(shape=x.shape, dtype=x.dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=self.dtype,
                            data_transpose=data_t, quantizer=self, device=x.device)

    def update_quantized(self, src, dst, *, noop_flag=None):
        """Cast src into dst's storage (same shape), refreshing its scale_inv."""
        if noop_flag is not None:
            raise NotImplementedError(f"{type(self).__name__}.update_quantized: noop_flag is not supported")
        if not isinstance(dst, Float8Tensor) or tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{type(self).__name__}.update_quantized: dst must be a Float8Tensor of src's shape")
        x = src.detach().contiguous()
        data = dst._data if self.rowwise_usage else None
        if self.rowwise_usage and data is None:
            data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        data_t = dst._transpose if self.columnwise_usage else None
        d, t, _ = self._cast(x, data, data_t, dst._scale_inv)
        dst._data, dst._transpose, dst._transpose_invalid = d, t, t is None
        dst._fp8_dtype = self.dtype
        return dst

    def make_empty(self, shape, *, dtype=torch.float32, device=None, requires_grad=False):
        """An uninitialised Float8Tensor of `shape` (its storage allocated)."""
        device = torch.device(device) if device is not None else self._device()
        shape = tuple(shape)
        data = torch.empty(shape, dtype=torch.uint8, device=device) if self.rowwise_usage else None
        data_t = None
        if self.columnwise_usage and len(shape) >= 2:
            rows = 1
            for d in shape[:-1]:
                rows *= d
            data_t = torch.empty(shape[-1], rows, dtype=torch.uint8, device=device)
        return Float8Tensor(shape=shape, dtype=dtype, data=data, fp8_scale_inv=torch.ones(1, device=device),
                            fp8_dtype=self.dtype, data_transpose=data_t, quantizer=self,
                            requires_grad=requires_grad, device=device)

    def _columnwise_for(self, x):
        return self.columnwise_usage and x.dim() >= 2

    def _quantize_with(self, x, scale, amax, data, data_t, scale_inv):
        return _fp8_engine.quantize(x, self.dtype, scale, amax=amax, rowwise=self.rowwise_usage,
                                    columnwise=self._columnwise_for(x), out=data, out_t=data_t,
                                    scale_inv=scale_inv)


class Float8Quantizer(_Quantizer):
    """Delayed scaling: cast with the given `scale` (float32, one element)
    and max the tensor's amax into `amax` (float32, one element)."""

    def __init__(self, scale, amax, fp8_dtype, *, rowwise=True, columnwise=True):
        super().__init__(fp8_dtype, rowwise, columnwise)
        for t, name in ((scale, "scale"), (amax, "amax")):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(f"Float8Quantizer: {name} must be a float32 tensor of one element")
        self.scale = scale
        self.amax = amax

    def _device(self):
        return self.scale.device

    def copy(self):
        q = Float8Quantizer(self.scale, self.amax, self.dtype, rowwise=self.rowwise_usage,
                            columnwise=self.columnwise_usage)
        q.internal = self.internal
        return q

    def _cast(self, x, data, data_t, scale_inv):
        return self._quantize_with(x, self.scale, self.amax, data, data_t, scale_inv)


class Float8CurrentScalingQuantizer(_Quantizer):
    """Current scaling: each cast takes the tensor's own amax (max-reduced
    over amax_reduction_group with with_amax_reduction, as sequence
    parallelism's gathered tensors need), makes the scale from it
    (force_pow_2_scales, amax_epsilon: TE's rule) and casts. self.scale and
    self.amax hold the last cast's values."""

    def __init__(self, fp8_dtype, device, *, rowwise=True, columnwise=True, with_amax_reduction=False,
                 amax_reduction_group=None, force_pow_2_scales=False, amax_epsilon=0.0):
        super().__init__(fp8_dtype, rowwise, columnwise)
        if with_amax_reduction and amax_reduction_group is None:
            raise ValueError("Float8CurrentScalingQuantizer: with_amax_reduction needs amax_reduction_group")
        if not isinstance(amax_epsilon, (int, float)) or not amax_epsilon >= 0:
            raise ValueError(f"Float8CurrentScalingQuantizer: amax_epsilon must be >= 0, got {amax_epsilon!r}")
        device = torch.device(device)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.amax = torch.zeros(1, dtype=torch.float32, device=device)
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)

    def _device(self):
        return self.scale.device

    def copy(self):
        q = Float8CurrentScalingQuantizer(self.dtype, self.scale.device, rowwise=self.rowwise_usage,
                                          columnwise=self.columnwise_usage,
                                          with_amax_reduction=self.with_amax_reduction,
                                          amax_reduction_group=self.amax_reduction_group,
                                          force_pow_2_scales=self.force_pow_2_scales,
                                          amax_epsilon=self.amax_epsilon)
        q.internal = self.internal
        return q

    def _cast(self, x, data, data_t, scale_inv):
        if x.device != self.scale.device:
            raise ValueError(f"Float8CurrentScalingQuantizer: input on {x.device}, quantizer on "
                             f"{self.scale.device}")
        _fp8_engine.amax(x, out=self.amax)
        if self.with_amax_reduction:
            torch.distributed.all_reduce(self.amax, op=torch.distributed.ReduceOp.MAX,
                                         group=self.amax_reduction_group)
        _fp8_engine.scale_from_amax(self.amax, self.dtype, power_2_scale=self.force_pow_2_scales,
                                    amax_epsilon=self.amax_epsilon, scale=self.scale)
        return self._quantize_with(x, self.scale, None, data, data_t, scale_inv)


class Float8ParamQuantizer(Float8Quantizer):
    """Delayed scaling's quantizer of an FP8 primary weight: a
    Float8Quantizer whose `scale` and `amax` are role `role` of `owner`'s
    fp8_meta (the forward scaling's scale and amax-history row 0), looked up
    at each cast, so a module that remakes its fp8_meta (a loaded
    checkpoint, a changed history length) keeps quantizing its weight with
    the scale its autocast updates. The owner is held weakly; without it the
    last fp8_meta seen is used. Rowwise only by default: the transpose is
    made from the bytes (Float8Tensor.get_transpose) when a GEMM needs it."""

    def __init__(self, owner, role, fp8_dtype, *, rowwise=True, columnwise=False):
        _Quantizer.__init__(self, fp8_dtype, rowwise, columnwise)
        meta = getattr(owner, "fp8_meta", None)
        if not meta or "scaling_fwd" not in meta:
            raise ValueError(f"Float8ParamQuantizer: {type(owner).__name__} has no delayed-scaling fp8_meta")
        if not 0 <= role < meta["scaling_fwd"].scale.numel():
            raise ValueError(f"Float8ParamQuantizer: role {role} is outside the fp8_meta's "
                             f"{meta['scaling_fwd'].scale.numel()} forward roles")
        self._owner = weakref.ref(owner)
        self._meta = meta
        self.role = role

    def _scaling(self):
        owner = self._owner()
        meta = getattr(owner, "fp8_meta", None) if owner is not None else None
        if meta and "scaling_fwd" in meta:
            self._meta = meta
        return self._meta["scaling_fwd"]

    @property
    def scale(self):
        return self._scaling().scale[self.role:self.role + 1]

    @property
    def amax(self):
        return self._scaling().amax_history[0][self.role:self.role + 1]

    def copy(self):
        q = Float8ParamQuantizer.__new__(Float8ParamQuantizer)
        q.__dict__.update(self.__dict__)
        return q

    def __deepcopy__(self, memo):
        """Within a deep copy of the owner: the copy's fp8_meta and owner."""
        q = Float8ParamQuantizer.__new__(Float8ParamQuantizer)
        memo[id(self)] = q
        q.__dict__.update(self.__dict__)
        owner = self._owner()
        q._owner = weakref.ref(memo.get(id(owner), owner)) if owner is not None else self._owner
        q._meta = copy.deepcopy(self._meta, memo)
        return q
