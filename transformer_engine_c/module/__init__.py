"""The layer modules (TransformerEngine's `transformer_engine.pytorch.module`
layout: `module.base` holds the userbuffers registry and the base module)."""
from . import base  # noqa: F401
from .base import TransformerEngineBaseModule, destroy_ub, get_ub, initialize_ub  # noqa: F401
from .layernorm_linear import LayerNormLinear  # noqa: F401
from .layernorm_mlp import LayerNormMLP  # noqa: F401
from .linear import Linear  # noqa: F401
from .grouped_linear import GroupedLinear  # noqa: F401
from .normalization import LayerNorm, RMSNorm  # noqa: F401
