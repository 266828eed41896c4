"""TransformerEngine's helpers from `transformer_engine.pytorch.utils` that
clients and TE's own tests import: weight initialisers, the unfused
attention mask function and the device queries."""
import math

import torch

__all__ = ["init_method_normal", "scaled_init_method_normal", "attention_mask_func", "get_device_compute_capability",
           "is_bf16_compatible", "is_bf16_available"]


def init_method_normal(sigma):
    """An init method (a function of the tensor, filled in place) drawing
    from N(0, sigma)."""
    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma, num_layers):
    """An init method drawing from N(0, sigma / sqrt(2 * num_layers)), for
    the output layers of a num_layers-deep residual stack."""
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)
    return init_


def attention_mask_func(attention_scores, attention_mask):
    """Fill the scores where the boolean mask is True (masked out) with
    -10000.0, in place; returns the scores."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def get_device_compute_capability():
    """(major, minor) of the current CUDA device; (0, 0) without CUDA, where
    the package runs on the CPU (so `>= (8, 0)` style checks read False)."""
    if not torch.cuda.is_available():
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))


def is_bf16_compatible():
    """Whether the device computes in bf16: a GPU of compute capability 8.0
    or newer, or the CPU (whose engine computes bf16 in float32)."""
    return not torch.cuda.is_available() or get_device_compute_capability()[0] >= 8


def is_bf16_available(return_reason=False):
    """TE's form: a bool, or (bool, reason) with an empty reason when bf16
    is available."""
    available = is_bf16_compatible()
    if not return_reason:
        return available
    return available, "" if available else "BF16 support requires a GPU with compute capability 8.0 or higher."
