"""TransformerEngine's FP8 tensor and quantizer names, for code that imports
them at module level: constructing one raises NotImplementedError (FP8 is
not supported by this package)."""
__all__ = ["Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer"]


class _Unsupported:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: FP8 tensors are not supported by transformer_engine_c")


class Float8Tensor(_Unsupported):
    pass


class Float8Quantizer(_Unsupported):
    pass


class Float8CurrentScalingQuantizer(_Unsupported):
    pass
