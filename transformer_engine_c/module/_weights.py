"""How a layer's autograd Function treats its weight so that a
DistributedWeight (or a plain tensor) works in every layer:

* forward and backward gather a DistributedWeight's full weight with
  TransformerEngineBaseModule._full_weight (`w.materialize()`, kept from the
  first micro-batch to the next when the caller passes is_first_microbatch);
* what backward returns as the weight's gradient goes through weight_grad.

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


def weight_grad(w, dw_full):
    """What backward returns as w's gradient: `dw_full` for a plain tensor;
    for a DistributedWeight, None after `w.reduce_grad(dw_full)` has put the
    reduced shard into w.main_grad / w.grad. `dw_full` None passes through."""
    if dw_full is not None and is_distributed_weight(w):
        w.reduce_grad(dw_full)
        return None
    return dw_full
