"""TransformerEngine's quantization entry points, for code that calls them
with quantization off: `fp8_autocast` / `autocast` and `fp8_model_init` /
`quantized_model_init` are no-op context managers with enabled=False and
raise NotImplementedError with enabled=True (the default, as in TE): this
package computes in fp32, bf16 and fp16. FP8GlobalStateManager answers TE's
queries (nothing is available, nothing is enabled)."""
import contextlib

from .recipe import DelayedScaling

__all__ = ["autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init", "get_default_fp8_recipe",
           "FP8GlobalStateManager", "is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
           "is_nvfp4_available"]

_NO_FP8 = "FP8 and other quantized compute are not supported by transformer_engine_c"


def _refuse(what, enabled):
    if enabled:
        raise NotImplementedError(f"{what}(enabled=True): {_NO_FP8}; use enabled=False or torch.autocast")


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
    """TE's quantized autocast: enabled=False runs the block unchanged."""
    _refuse("autocast", enabled or calibrating)
    yield


@contextlib.contextmanager
def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    """TE's fp8_autocast: enabled=False runs the block unchanged."""
    _refuse("fp8_autocast", enabled or calibrating)
    yield


@contextlib.contextmanager
def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """TE's quantized_model_init: enabled=False builds parameters as usual."""
    _refuse("quantized_model_init", enabled)
    yield


@contextlib.contextmanager
def fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """TE's fp8_model_init: enabled=False builds parameters as usual."""
    _refuse("fp8_model_init", enabled)
    yield


def get_default_fp8_recipe():
    """TE's default recipe (plain data here)."""
    return DelayedScaling()


def _unavailable():
    return False, _NO_FP8


is_fp8_available = is_mxfp8_available = is_fp8_block_scaling_available = is_nvfp4_available = _unavailable


class FP8GlobalStateManager:
    """The queries TE's callers make of its global FP8 state."""

    is_fp8_available = staticmethod(_unavailable)
    is_mxfp8_available = staticmethod(_unavailable)
    is_fp8_block_scaling_available = staticmethod(_unavailable)
    is_nvfp4_available = staticmethod(_unavailable)

    @staticmethod
    def is_fp8_enabled():
        return False

    @staticmethod
    def is_fp8_calibration():
        return False

    @staticmethod
    def with_fp8_parameters():
        return False

    @staticmethod
    def fp8_graph_capturing():
        return False

    @staticmethod
    def get_fp8_recipe():
        return get_default_fp8_recipe()
