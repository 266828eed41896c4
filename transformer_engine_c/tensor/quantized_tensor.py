"""TransformerEngine's `QuantizedTensor`: the base class of quantized
parameter and activation tensors, for code that tests `isinstance(t,
QuantizedTensor)` (Megatron-Core does, to find FP8 parameters). This
package's one subclass is Float8Tensor (float8_tensor.py: FP8 primary
weights, the quantizers' outputs) and Float8BlockwiseQTensor; the base
class itself cannot be instantiated. on_values() is the torch-op fallback
both share: dequantized arguments, and TE's in-place rule (the result cast
back into each quantized tensor an op writes)."""
import torch

__all__ = ["QuantizedTensor", "QuantizedTensorStorage", "Quantizer"]


class QuantizedTensorStorage:
    """TE's base of the quantized tensors' storage classes (the data and
    scales without the torch.Tensor around them), for isinstance checks:
    every quantized tensor of this package is one."""


class Quantizer:
    """TE's base class of the quantizers (Float8Quantizer,
    Float8CurrentScalingQuantizer, Float8BlockQuantizer, ...), for
    isinstance checks; the base itself quantizes nothing."""


class QuantizedTensor(torch.Tensor):
    """Base of the quantized tensors (a torch.Tensor subclass). Subclasses
    implement dequantize(); the base class raises on construction."""

    def __new__(cls, *args, **kwargs):
        if cls is QuantizedTensor:
            raise NotImplementedError("QuantizedTensor is an abstract base class: construct a subclass")
        return super().__new__(cls, *args, **kwargs)

    def dequantize(self, *, dtype=None):
        raise NotImplementedError(f"{type(self).__name__}.dequantize is not implemented")


def _written_args(func):
    """Indices of the arguments an ATen op writes (in-place, out=)."""
    return [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def on_values(func, args, kwargs):
    """Run ATen `func` on the dequantized values of the QuantizedTensors in
    args / kwargs. Where it writes an argument (an optimizer's add_, a
    copy_, a foreach list), the written values are quantized back into that
    QuantizedTensor's own storage (its quantize_, TE's in-place rule) and
    the op returns the QuantizedTensor itself; otherwise plain tensors."""
    def plain(a):
        return a.dequantize() if isinstance(a, QuantizedTensor) else a

    p_args = torch.utils._pytree.tree_map(plain, args)
    p_kwargs = torch.utils._pytree.tree_map(plain, kwargs)
    out = func(*p_args, **p_kwargs)
    written = _written_args(func) if func._schema.is_mutable else ()
    back = {}
    for i in written:
        if i >= len(args):
            continue
        origs, news = (args[i], p_args[i]) if isinstance(args[i], (list, tuple)) else ((args[i],), (p_args[i],))
        for o, n in zip(origs, news):
            if isinstance(o, QuantizedTensor):
                o.quantize_(n)
                back[id(n)] = o
    if not back:
        return out
    return torch.utils._pytree.tree_map(lambda r: back.get(id(r), r), out)
