"""The names of TransformerEngine's operation-based API
(`transformer_engine.pytorch.ops`), for code that refers to them at import
time (Megatron-Core's TEFusedMLP annotates with them): the API itself is not
offered, and constructing any of them raises NotImplementedError. Use the
modules (Linear, LayerNormLinear, LayerNormMLP) instead."""

__all__ = ["FusibleOperation", "Sequential", "BasicLinear", "Bias", "LayerNorm", "RMSNorm", "GELU", "GEGLU",
           "SiLU", "SwiGLU", "ReLU", "ReGLU", "AllReduce", "ReduceScatter", "AllGather"]


class FusibleOperation:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"transformer_engine.pytorch.ops.{type(self).__name__}: TE's operation-based "
                                  "API (te.ops) is not supported by transformer_engine_c; use its modules "
                                  "(for Megatron-Core: use_te_op_fuser=False)")


def _op(name):
    return type(name, (FusibleOperation,), {"__doc__": f"TE's ops.{name} (not supported: raises)."})


Sequential = _op("Sequential")
BasicLinear = _op("BasicLinear")
Bias = _op("Bias")
LayerNorm = _op("LayerNorm")
RMSNorm = _op("RMSNorm")
GELU = _op("GELU")
GEGLU = _op("GEGLU")
SiLU = _op("SiLU")
SwiGLU = _op("SwiGLU")
ReLU = _op("ReLU")
ReGLU = _op("ReGLU")
AllReduce = _op("AllReduce")
ReduceScatter = _op("ReduceScatter")
AllGather = _op("AllGather")
