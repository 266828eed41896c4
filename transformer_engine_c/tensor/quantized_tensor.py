"""TransformerEngine's `QuantizedTensor`: the base class of quantized
parameter and activation tensors, for code that tests `isinstance(t,
QuantizedTensor)` (Megatron-Core does, to find FP8 parameters). This
package's one subclass is Float8Tensor (float8_tensor.py: FP8 primary
weights, the quantizers' outputs); the base class itself cannot be instantiated."""
import torch

__all__ = ["QuantizedTensor"]


class QuantizedTensor(torch.Tensor):
    """Base of the quantized tensors (a torch.Tensor subclass). Subclasses
    implement dequantize(); the base class raises on construction."""

    def __new__(cls, *args, **kwargs):
        if cls is QuantizedTensor:
            raise NotImplementedError("QuantizedTensor is an abstract base class: construct a subclass")
        return super().__new__(cls, *args, **kwargs)

    def dequantize(self, *, dtype=None):
        raise NotImplementedError(f"{type(self).__name__}.dequantize is not implemented")
