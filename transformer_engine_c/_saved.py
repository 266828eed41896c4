"""prepare_for_saving / restore_from_saved with TransformerEngine's
signatures. The layers call the C implementation directly
(csrc/python/saving.c documents the protocol); restore_from_saved here adds
TE's `return_saved_tensors` and accepts TE's own list of objects, and
restore_from_func_ctx is TE's ctx-based form."""
import torch

from . import _C
from ._C import prepare_for_saving

__all__ = ["prepare_for_saving", "restore_from_saved", "restore_from_func_ctx"]

_SavedObjects = type(_C.prepare_for_saving()[1])


def restore_from_saved(tensors, saved_tensors, return_saved_tensors=False):
    """The objects prepare_for_saving was given, from `tensors` (what it
    returned beside the tensors to save) and the saved tensors autograd hands
    back. With return_saved_tensors, also the saved tensors left over (a
    caller may have saved more after them): (objects, rest)."""
    if type(tensors) is _SavedObjects:
        if not return_saved_tensors:
            return _C.restore_from_saved(tensors, saved_tensors)
        saved_tensors = tuple(saved_tensors)
        n = tensors.n_saved
        return _C.restore_from_saved(tensors, saved_tensors[:n]), list(saved_tensors[n:])
    # TE's form: a list with None / a tensor (restored from the next saved
    # tensor) or an object with its own restore_from_saved(saved) -> rest.
    objects, rest = [], list(saved_tensors)
    for t in tensors:
        if t is None or isinstance(t, torch.Tensor):
            objects.append(rest.pop(0))
        else:
            rest = list(t.restore_from_saved(rest))
            objects.append(t)
    return (objects, rest) if return_saved_tensors else objects


def restore_from_func_ctx(ctx, return_saved_tensors=False):
    """restore_from_saved(ctx.tensor_objects, ctx.saved_tensors), dropping
    ctx.tensor_objects (TE's convention for a Function's context)."""
    objects = getattr(ctx, "tensor_objects", None)
    if objects is None:
        raise AttributeError("restore_from_func_ctx: ctx has no tensor_objects (set ctx.tensor_objects to what "
                             "prepare_for_saving returned)")
    out = restore_from_saved(objects, ctx.saved_tensors, return_saved_tensors=return_saved_tensors)
    ctx.tensor_objects = None
    return out
