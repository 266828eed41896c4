"""transformer_engine_c: tensor-parallel layers with comm-GEMM overlap."""
import torch

from . import _C

_C._init(torch.Tensor)

from .userbuffers import CommOverlap, CommTimeoutError, destroy_ub, get_ub, initialize_ub  # noqa: E402
