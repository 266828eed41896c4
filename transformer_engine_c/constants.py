"""TransformerEngine's `DType`: the engine's data type tags as TE numbers
them (transformer_engine.h's enum), for code that passes them to a
quantizer (`Float8Quantizer(scale, amax, DType.kFloat8E4M3)`). The
quantizers take a DType or the torch float8 dtype alike."""
import enum

import torch

__all__ = ["DType"]


class DType(enum.IntEnum):
    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10

    def torch_dtype(self):
        """The torch dtype of this tag (ValueError for FP4, which torch
        stores packed and this package does not offer)."""
        try:
            return _TORCH[self]
        except KeyError:
            raise ValueError(f"DType.{self.name} has no torch dtype here (FP4 is not offered)") from None


_TORCH = {DType.kByte: torch.uint8, DType.kInt32: torch.int32, DType.kFloat32: torch.float32,
          DType.kFloat16: torch.float16, DType.kBFloat16: torch.bfloat16, DType.kFloat8E4M3: torch.float8_e4m3fn,
          DType.kFloat8E5M2: torch.float8_e5m2}
