"""transformer_engine_c: tensor-parallel Linear and LayerNormLinear layers
whose engine is C and CUDA C (see README.md)."""
import torch

from . import _C

_C._init(torch.Tensor)

from . import debug  # noqa: E402
from ._C import CommTimeoutError, EngineError  # noqa: E402
from .module.layernorm_linear import LayerNormLinear  # noqa: E402
from .module.linear import Linear  # noqa: E402

__all__ = ["Linear", "LayerNormLinear", "EngineError", "CommTimeoutError"]
