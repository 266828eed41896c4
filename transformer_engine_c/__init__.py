"""transformer_engine_c: TransformerEngine's tensor-parallel Linear and
LayerNormLinear layers (same names, arguments and semantics, so
`import transformer_engine_c as te` serves code written against
`transformer_engine.pytorch` for what is offered) whose engine is C and CUDA
C, with userbuffers overlap of the sequence-parallel collectives (see
README.md)."""
import torch

from . import _C

_C._init(torch.Tensor, torch.nn.Parameter)

from . import debug, fp8, module, ops, quantization, recipe, router, tensor, utils  # noqa: E402,F401
from ._C import CommTimeoutError, EngineError  # noqa: E402
from ._saved import prepare_for_saving, restore_from_func_ctx, restore_from_saved  # noqa: E402
from ._alias import install_as_transformer_engine  # noqa: E402
from .attention import DotProductAttention, MultiheadAttention, RotaryPositionEmbedding  # noqa: E402
from .checkpoint import checkpoint  # noqa: E402
from .distributed import allreduce_sequence_parallel_grads, set_collectives  # noqa: E402
from .distributed_weight import DistributedWeight  # noqa: E402
from .graph import make_graphed_callables  # noqa: E402
from .module.base import UserBufferQuantizationMode, destroy_ub, get_ub, initialize_ub  # noqa: E402
from .module.grouped_linear import GroupedLinear  # noqa: E402
from .module.layernorm_linear import LayerNormLinear  # noqa: E402
from .module.layernorm_mlp import LayerNormMLP  # noqa: E402
from .module.linear import Linear  # noqa: E402
from .module.normalization import LayerNorm, RMSNorm  # noqa: E402
from .constants import DType  # noqa: E402
from .inference import InferenceParams  # noqa: E402
from .quantization import (autocast, fp8_autocast, fp8_model_init, get_default_recipe, is_fp8_available,  # noqa: E402
                           is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available,
                           quantized_model_init)
from .tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage,  # noqa: E402
                     Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, Float8TensorStorage,
                     MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage, NVFP4Quantizer, NVFP4Tensor,
                     NVFP4TensorStorage, QuantizedTensor, QuantizedTensorStorage, Quantizer)
from .utils import get_device_compute_capability, is_bf16_available  # noqa: E402
from .transformer import TransformerLayer  # noqa: E402
from .userbuffers import LAYER_NAMES, CommOverlap, close_comms  # noqa: E402

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "EngineError", "CommTimeoutError", "prepare_for_saving",
           "restore_from_saved", "restore_from_func_ctx", "DistributedWeight", "checkpoint", "CommOverlap",
           "initialize_ub", "get_ub", "destroy_ub", "close_comms", "UserBufferQuantizationMode",
           "allreduce_sequence_parallel_grads", "set_collectives", "autocast", "fp8_autocast", "fp8_model_init",
           "quantized_model_init", "make_graphed_callables", "install_as_transformer_engine", "LayerNorm",
           "RMSNorm", "DotProductAttention", "GroupedLinear", "RotaryPositionEmbedding",
           "MultiheadAttention", "TransformerLayer", "DType", "InferenceParams", "get_default_recipe",
           "is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available",
           "get_device_compute_capability", "is_bf16_available", "Quantizer", "Float8Quantizer",
           "Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer", "NVFP4Quantizer",
           "QuantizedTensorStorage", "Float8TensorStorage", "MXFP8TensorStorage", "Float8BlockwiseQTensorStorage",
           "NVFP4TensorStorage", "QuantizedTensor", "Float8Tensor", "MXFP8Tensor", "Float8BlockwiseQTensor",
           "NVFP4Tensor"]


def __getattr__(name):
    # `alias` is imported on first use, not with the package, so that
    # `python -m transformer_engine_c.alias` finds it not yet imported
    if name == "alias":
        import importlib
        return importlib.import_module(".alias", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
