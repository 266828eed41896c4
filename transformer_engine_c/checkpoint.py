"""tec.checkpoint: activation checkpointing for models built of our layers.

A thin wrapper over torch.utils.checkpoint. It is correct with
DistributedWeight because nothing materialised outlives a step: the
recomputed forward gathers the weight again (its is_first_microbatch rules
unchanged), and the layers' backward gets the original weight object from restore_from_saved
(keep-by-reference) in both modes:
  * use_reentrant=True: the forward runs under no_grad, the backward reruns it
    with grad and backpropagates through the rerun graph;
  * use_reentrant=False: saved tensors are dropped at pack time and recomputed
    when backward unpacks them.
Called with grad disabled (an evaluation forward) it is a plain call: no
graph is recorded, so nothing would be recomputed.
Collectives inside the checkpointed function (gathers, TP all-reduces) run
again in the recomputation, in the same order on every rank.

TE's arguments: `get_rng_state_tracker` (the tracker's named states are
those of the forward again while the recomputation runs, so dropout under
its fork() draws the same masks; the states after backward are those
before the recomputation), `tp_group`, and `distribute_saved_activations`
(not supported with use_reentrant=True: NotImplementedError; with
use_reentrant=False it has no effect, as in TE, and warns). The function
runs under `activation_recompute_forward` (recompute_phase in backward).
Inside an FP8 autocast the recomputation runs in the forward's autocast
again (its recipe and group, without the exit's amax update), and each
layer casts with the scales its forward used (module/_fp8.py), so the
recomputed FP8 values are the forward's. Traced by torch.compile it is
PyTorch's non-reentrant checkpoint; under an FP8 autocast its FP8 layer
calls keep their forward (a selective-checkpoint policy) instead of running
again in the compiled backward, outside the autocast.
"""
import contextlib
import warnings

import torch
import torch.utils.checkpoint

from . import _library
from . import quantization as _quantization
from .quantization import FP8GlobalStateManager, autocast
from .te_distributed import activation_recompute_forward

__all__ = ["checkpoint"]


def checkpoint(function, *args, use_reentrant=True, preserve_rng_state=True, distribute_saved_activations=False,
               get_rng_state_tracker=None, tp_group=None, **kwargs):
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
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("checkpoint: get_rng_state_tracker must be a callable returning the tracker, got "
                        f"{type(get_rng_state_tracker).__name__}")
    if distribute_saved_activations:
        if use_reentrant:
            raise NotImplementedError("checkpoint: distribute_saved_activations=True (the saved input split "
                                      "over tp_group) is not supported; pass False")
        warnings.warn("checkpoint: distribute_saved_activations=True has no effect with use_reentrant=False",
                      stacklevel=2)
    if torch.compiler.is_compiling():
        # Traced by torch.compile: PyTorch's non-reentrant checkpoint, which the
        # compiler turns into a recomputation inside the compiled backward.
        if get_rng_state_tracker is not None:
            raise NotImplementedError("checkpoint: get_rng_state_tracker inside a function torch.compile traces "
                                      "is not supported (call the checkpointed part eagerly)")
        if _quantization.fp8_enabled:
            kwargs["context_fn"] = _keep_fp8_calls
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                 preserve_rng_state=preserve_rng_state, **kwargs)
    if not torch.is_grad_enabled():
        # no graph is recorded, so nothing is recomputed: a plain call (a checkpointed forward would stash
        # the FP8 scales for a recomputation that never comes, and a later one would cast with them)
        return function(*args, **kwargs)
    function = _recomputable(function, get_rng_state_tracker)
    if use_reentrant:
        if kwargs:
            bad = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
            if bad:
                raise ValueError(f"checkpoint: with use_reentrant=True, pass tensors that require grad "
                                 f"positionally (keyword arguments {bad} would get no gradient)")

            def call(*a):
                return function(*a, **kwargs)
        else:
            call = function
        # A leaf that needs grad among the outputs (a layer's bias under
        # return_bias) must not pass through torch's reentrant checkpoint: it
        # comes out as that same Parameter turned into a non-leaf with a
        # grad_fn, and backward then recurses without end. Such outputs are
        # handed back directly; they hold no activation to recompute.
        leaves = {}

        def run(*a):
            out = call(*a)
            if isinstance(out, torch.Tensor):
                if _grad_leaf(out):
                    leaves[None] = out
                    return None
                return out
            if isinstance(out, (tuple, list)):
                found = {i: o for i, o in enumerate(out) if _grad_leaf(o)}
                if found:
                    leaves.update(found)
                    return type(out)(None if i in found else o for i, o in enumerate(out))
            return out
        res = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True,
                                                preserve_rng_state=preserve_rng_state)
        if None in leaves:
            return leaves[None]
        if leaves:
            return type(res)(leaves.get(i, o) for i, o in enumerate(res))
        return res
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             preserve_rng_state=preserve_rng_state, **kwargs)


def _keep_fp8_policy(ctx, op, *args, **kwargs):
    """A traced checkpoint's policy under an FP8 autocast: an FP8 layer call
    keeps its forward (its FP8 operands wait for the backward under the
    call's token, module/_opcall.py) instead of running again in the
    compiled backward, outside the autocast; the rest is recomputed."""
    if op is _library.layer_fwd and args[4]:
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _keep_fp8_calls():
    forward, recompute = torch.utils.checkpoint.create_selective_checkpoint_contexts(_keep_fp8_policy)
    forward.__class__ = _keeping(type(forward))
    return forward, recompute


_KEEPING = {}


def _keeping(mode_class):
    """The forward mode class of a tec.checkpoint region: torch's selective
    checkpoint mode, counting the open regions in
    _library.fp8_keeping_regions while the compiler traces them."""
    cls = _KEEPING.get(mode_class)
    if cls is None:
        class cls(mode_class):
            def __enter__(self):
                _library.fp8_keeping_regions += 1
                return super().__enter__()

            def __exit__(self, *exc):
                try:
                    return super().__exit__(*exc)
                finally:
                    _library.fp8_keeping_regions -= 1
        cls.__name__ = cls.__qualname__ = "TecCheckpointMode"
        _KEEPING[mode_class] = cls
    return cls


def _copy_states(states):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else
                v.clone_state() if isinstance(v, torch.Generator) else v) for k, v in states.items()}


def _recomputable(function, get_rng_state_tracker):
    """function, run under activation_recompute_forward: its first call is the
    forward, later ones recomputations, which see the tracker's states as the
    forward saw them."""
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    forward_states = []
    fp8_state = []

    def run(*a, **kw):
        if not forward_states:
            forward_states.append(_copy_states(tracker.get_states()) if tracker is not None else None)
            fp8_state.append(FP8GlobalStateManager.get_autocast_state())
            with activation_recompute_forward(activation_recompute=True, recompute_phase=False):
                return function(*a, **kw)
        now = None
        if tracker is not None:
            now = tracker.get_states()
            tracker.set_states(_copy_states(forward_states[0]))
        enabled, calibrating, recipe, group = fp8_state[0][:4]
        try:
            # the forward's FP8 autocast again, without its exit's amax update (TE's _graph=True)
            with activation_recompute_forward(activation_recompute=True, recompute_phase=True), \
                    autocast(enabled=enabled, calibrating=calibrating, recipe=recipe,
                             amax_reduction_group=group, _graph=True) if enabled else contextlib.nullcontext():
                return function(*a, **kw)
        finally:
            if tracker is not None:
                tracker.set_states(now)
    return run


def _grad_leaf(t):
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad
