"""transformer_engine_c: tensor-parallel layers with comm-GEMM overlap."""
import torch

from . import _C

_C._init(torch.Tensor)
