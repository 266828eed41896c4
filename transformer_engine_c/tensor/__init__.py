"""TransformerEngine's quantized tensor and quantizer names, for code that
imports them: per-tensor FP8 (float8_tensor.py), block-scaled FP8
(float8_blockwise_tensor.py), the bases (quantized_tensor.py), and
Blackwell's MXFP8 / NVFP4 classes, which are not offered (blackwell.py:
the quantizers construct and raise when asked to quantize; the tensors
raise when constructed)."""
from .._saved import prepare_for_saving, restore_from_saved
from .blackwell import (MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage, NVFP4Quantizer, NVFP4Tensor,
                        NVFP4TensorStorage)
from .float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage
from .float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, Float8TensorStorage
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer

__all__ = ["Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer",
           "NVFP4Quantizer", "QuantizedTensorStorage", "Float8TensorStorage", "MXFP8TensorStorage",
           "Float8BlockwiseQTensorStorage", "NVFP4TensorStorage", "QuantizedTensor", "Float8Tensor", "MXFP8Tensor",
           "Float8BlockwiseQTensor", "NVFP4Tensor", "prepare_for_saving", "restore_from_saved"]
