"""TransformerEngine's `cpp_extensions`: the Python front of its C++
operators. This package offers `general_gemm` (gemm.py) on the engine's
GEMMs; TE's other extensions (fused attention, grouped GEMM, the comm+GEMM
overlap types) are not here: the layers and CommOverlap reach the engine
their own way."""
from .gemm import general_gemm

__all__ = ["general_gemm"]
