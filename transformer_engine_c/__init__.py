"""transformer_engine_c: tensor-parallel layers with comm-GEMM overlap."""
import torch

from . import _C

_C._init(torch.Tensor)

# saved tensors and DistributedWeight (docs: csrc/python/saving.c, distributed_weight.py)
prepare_for_saving = _C.prepare_for_saving
restore_from_saved = _C.restore_from_saved
from .distributed_weight import DistributedWeight  # noqa: E402
from .checkpoint import checkpoint  # noqa: E402
