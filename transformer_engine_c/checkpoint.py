"""tec.checkpoint: activation checkpointing for models built of our layers.

A thin wrapper over torch.utils.checkpoint. It is correct with
DistributedWeight because nothing materialised is cached: the recomputed
forward calls weight_for_compute() again, which all-gathers again, and the
layers' backward gets the original weight object from restore_from_saved
(keep-by-reference) in both modes:
  * use_reentrant=True: the forward runs under no_grad, the backward reruns it
    with grad and backpropagates through the rerun graph;
  * use_reentrant=False: saved tensors are dropped at pack time and recomputed
    when backward unpacks them.
Collectives inside the checkpointed function (gathers, TP all-reduces) run
again in the recomputation, in the same order on every rank.
"""
import torch
import torch.utils.checkpoint

__all__ = ["checkpoint"]


def checkpoint(function, *args, use_reentrant=True, preserve_rng_state=True, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations; they are
    recomputed in backward. ``use_reentrant`` defaults to True as in TE's
    ``te.checkpoint``. In reentrant mode tensors that need gradients must be
    positional: torch's reentrant checkpoint only differentiates its positional
    arguments, so such a tensor in ``kwargs`` is an error rather than a silently
    missing gradient."""
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {type(function).__name__}")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"checkpoint: use_reentrant must be a bool, got {type(use_reentrant).__name__}")
    if use_reentrant:
        if kwargs:
            bad = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
            if bad:
                raise ValueError(f"checkpoint: with use_reentrant=True, pass tensors that require grad "
                                 f"positionally (keyword arguments {bad} would get no gradient)")

            def run(*a):
                return function(*a, **kwargs)
        else:
            run = function
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True,
                                                 preserve_rng_state=preserve_rng_state)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             preserve_rng_state=preserve_rng_state, **kwargs)
