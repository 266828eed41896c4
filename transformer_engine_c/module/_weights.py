"""How a layer's autograd function uses its weight: the two hooks every layer
calls, so a DistributedWeight (or a plain tensor) works in every layer.

    w_full = weight_for_compute(w)      # forward, and again in backward
    ...
    return ..., weight_grad(w, dw_full), ...   # backward's gradient for w

`w` in backward must be the object restore_from_saved returned (the original
DistributedWeight, kept by reference), not a tensor that a saved-tensor hook
unpacked. Grad routing: for a DistributedWeight, weight_grad reduce-scatters
dw_full into w's shard (accumulating into w.main_grad if present, else
w.grad) and returns None, so autograd does not accumulate a second time.
"""
import torch

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def is_distributed_weight(w):
    return type(w) is not _Tensor and type(w) is not _Parameter and getattr(w, "is_distributed_weight", False)


def weight_for_compute(w):
    """The full weight to use in a GEMM: `w` for a plain tensor, a fresh
    all-gather (`w.materialize()`) for a DistributedWeight. Not cached: the
    full weight is not kept between forward and backward."""
    if is_distributed_weight(w):
        return w.materialize()
    return w


def weight_grad(w, dw_full):
    """What backward returns as w's gradient: `dw_full` for a plain tensor;
    for a DistributedWeight, None after `w.reduce_grad(dw_full)` has put the
    reduced shard into w.main_grad / w.grad. `dw_full` None passes through."""
    if dw_full is not None and is_distributed_weight(w):
        w.reduce_grad(dw_full)
        return None
    return dw_full
