"""transformer_engine_c: tensor-parallel Linear and LayerNormLinear layers
whose engine is C and CUDA C (see README.md)."""
import torch

from . import _C

_C._init(torch.Tensor, torch.nn.Parameter)

from . import debug  # noqa: E402,F401  (tec.debug)
from ._C import CommTimeoutError, EngineError  # noqa: E402
from ._C import prepare_for_saving, restore_from_saved  # noqa: E402
from .checkpoint import checkpoint  # noqa: E402
from .distributed_weight import DistributedWeight  # noqa: E402
from .module.layernorm_linear import LayerNormLinear  # noqa: E402
from .module.linear import Linear  # noqa: E402
from .userbuffers import LAYER_NAMES, CommOverlap, close_comms, destroy_ub, get_ub, initialize_ub  # noqa: E402

__all__ = ["Linear", "LayerNormLinear", "EngineError", "CommTimeoutError", "prepare_for_saving",
           "restore_from_saved", "DistributedWeight", "checkpoint", "CommOverlap", "initialize_ub",
           "get_ub", "destroy_ub", "close_comms"]
