"""TransformerEngine's MXFP8 and NVFP4 quantizer and tensor classes, which
need a Blackwell GPU (sm_100) and are not offered by this package: the
classes exist so that code can import them and test `isinstance` (never
true here); constructing one raises NotImplementedError naming the format.
quantization.check_mxfp8_support / check_nvfp4_support answer False."""
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer

__all__ = ["MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage", "NVFP4Quantizer", "NVFP4Tensor",
           "NVFP4TensorStorage"]

_FORMATS = {"MXFP8": "MXFP8 (32-element blocks with E8M0 scales)",
            "NVFP4": "NVFP4 (FP4 E2M1 with 16-element blocks)"}


def _refuse(cls):
    fmt = "MXFP8" if cls.__name__.startswith("MXFP8") else "NVFP4"
    raise NotImplementedError(f"{cls.__name__}: {_FORMATS[fmt]} is Blackwell's (sm_100) format, which "
                              "transformer_engine_c does not offer; use Float8CurrentScaling, DelayedScaling or "
                              "Float8BlockScaling")


class MXFP8Quantizer(Quantizer):
    """TE's MXFP8 quantizer (not offered: construction raises)."""

    def __init__(self, fp8_dtype=None, *, rowwise=True, columnwise=True):
        _refuse(type(self))


class NVFP4Quantizer(Quantizer):
    """TE's NVFP4 quantizer (not offered: construction raises)."""

    def __init__(self, *args, **kwargs):
        _refuse(type(self))


class MXFP8TensorStorage(QuantizedTensorStorage):
    """TE's MXFP8 storage class (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls)


class NVFP4TensorStorage(QuantizedTensorStorage):
    """TE's NVFP4 storage class (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls)


class MXFP8Tensor(MXFP8TensorStorage, QuantizedTensor):
    """TE's MXFP8 tensor (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls)


class NVFP4Tensor(NVFP4TensorStorage, QuantizedTensor):
    """TE's NVFP4 tensor (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls)
