"""TransformerEngine's `pytorch.attention` package: DotProductAttention
(dot_product_attention.py, with context parallelism in
context_parallel.py), MultiheadAttention (multi_head_attention.py) and
rotary position embedding (rope.py)."""
from .dot_product_attention import DotProductAttention
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding

__all__ = ["DotProductAttention", "MultiheadAttention", "RotaryPositionEmbedding"]
