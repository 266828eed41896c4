"""TransformerEngine's older module name for its quantization entry points
(`transformer_engine.pytorch.fp8`); see quantization.py."""
from .quantization import *  # noqa: F401,F403
from .quantization import __all__  # noqa: F401
