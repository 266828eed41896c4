"""tec.make_graphed_callables: TransformerEngine 2.x's make_graphed_callables
over PyTorch's torch.cuda.make_graphed_callables, for this package's layers,
FP8 included.

The layers capture as they are: every engine call (norm, activation, cast,
GEMM) is enqueued on the current stream with workspaces from PyTorch's
allocator, so a graphed forward+backward replays the same kernels on the
same memory. Userbuffers overlap captures too: the handshakes take their
epochs from device memory when they run and advance them there, so a graph
replays any number of times, and several graphs and eager calls share a
communicator (docs/architecture.md, "CUDA graphs"). One feature cannot be
replayed and is refused: DistributedWeight (its gather is a collective
issued per call; the layers refuse it under capture). make_graphed_callables
checks for it before it captures, naming the layer.

FP8 (`fp8_enabled`, TE's semantics). Each module is warmed up and captured
inside autocast(fp8_enabled, fp8_recipe, fp8_group, _graph=True), so its
casts and FP8 GEMMs are in its graphs; what TE does around a replay is done
here too (docs/fp8.md, "CUDA graphs"):

* DelayedScaling. The graphs read every scale from the layers' fp8_meta and
  max every amax into its history's row 0, in device memory at the
  addresses of capture time. The updates stay outside the graphs, where
  eager steps run them: the forward roles' when the outermost autocast
  around the replay exits, the backward roles' right after the backward
  graph of the first graphed FP8 callable of that autocast has replayed (no
  layer under capture runs it). Both update in place, so each replay reads
  the scales the previous step left, and a graphed step replayed any number
  of times gives the eager steps' results. Replay inside
  autocast(enabled=True, recipe=...) as the eager steps would run (outside
  one the scales do not move). The warm-up's amaxes are dropped: the
  fp8_meta tensors are restored after capture to what they held before.
* Float8CurrentScaling needs nothing more: every cast takes its amax and
  scale on the device when it runs.
* fp8_weight_caching=True: the graphed module takes `is_first_microbatch`
  (a bool, required) and, before each replay, writes the device flag
  FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() = not
  is_first_microbatch. The weight casts captured read it (the engine's
  quantize noop flag): set, they write nothing, and the later micro-batches'
  GEMMs read the first one's FP8 weight from the layer's graph buffer
  (module/_fp8.FP8Call.graph_weight), as eager is_first_microbatch=False
  does. Without caching every replay casts the weights as they are then.

Refused, with the argument named: fp8_calibrating (calibration is not
implemented), weight caching under Float8BlockScaling, FP8 for a callable
that is not a torch.nn.Module, sample_kwargs, _order, retain_graph_in_backward.
"""
import contextlib
import gc

import torch
from torch.utils import _pytree

from .quantization import FP8GlobalStateManager as _State, autocast, get_default_fp8_recipe
from .recipe import DelayedScaling, Float8BlockScaling, Recipe

__all__ = ["make_graphed_callables"]


def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           sample_kwargs=None, fp8_enabled=False, fp8_calibrating=False, fp8_recipe=None,
                           fp8_group=None, fp8_weight_caching=False, _order=None, pool=None,
                           retain_graph_in_backward=False):
    """Capture `modules` (a callable or a tuple of them) with `sample_args`
    (a tuple of inputs, or a tuple of such tuples) into CUDA graphs for
    forward and backward; returns graphed callables as
    torch.cuda.make_graphed_callables does (a module comes back with its
    forward replaced). fp8_enabled (a bool, or one per callable),
    fp8_recipe (default: get_default_fp8_recipe()), fp8_group and
    fp8_weight_caching as in TE (see the module docstring);
    `sample_kwargs` must be empty, `_order` (pipeline-parallel interleaving)
    None, `retain_graph_in_backward` and `fp8_calibrating` False; each
    raises otherwise."""
    callables = modules if isinstance(modules, tuple) else (modules,)
    enabled, recipe = _check_arguments(callables, sample_kwargs, fp8_enabled, fp8_calibrating, fp8_recipe,
                                       fp8_weight_caching, _order, retain_graph_in_backward)
    if any(enabled) and num_warmup_iters < 1:
        raise ValueError("make_graphed_callables: FP8 needs num_warmup_iters >= 1 (the layers make their FP8 "
                         f"state on their first call, which must not be captured), got {num_warmup_iters}")
    for m in callables:
        _check_capturable(m)
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs a CUDA device (CUDA graphs)")
    flag = _State.set_skip_fp8_weight_update_tensor(False) if fp8_weight_caching else None
    saved = save_fp8_tensors(callables)
    captures = [_Capture(c, e, recipe, fp8_group, flag) if isinstance(c, torch.nn.Module) else None
                for c, e in zip(callables, enabled)]
    done = False
    try:
        with _collector_paused():
            graphed = torch.cuda.make_graphed_callables(modules, sample_args, num_warmup_iters=num_warmup_iters,
                                                        allow_unused_input=allow_unused_input, pool=pool)
        done = True
    finally:
        for cap in captures:
            if cap is not None:
                cap.finish(done)
        restore_fp8_tensors(saved)
    return graphed


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while the callables are warmed
    up and captured, after one collection. A collection that runs during a
    capture finalizes whatever garbage earlier work left, and a finalizer
    may make a CUDA call that a capture forbids (a communicator's destroy
    synchronizes the device): the capture then fails in whatever call comes
    next, and only in a process with such garbage. torch.cuda.graph no longer
    collects before it captures."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_arguments(callables, sample_kwargs, fp8_enabled, fp8_calibrating, fp8_recipe, fp8_weight_caching,
                     _order, retain_graph_in_backward):
    """TE's arguments checked before anything runs: (per-callable FP8
    flags, the recipe or None)."""
    if sample_kwargs and any(sample_kwargs if isinstance(sample_kwargs, dict) else sample_kwargs):
        raise NotImplementedError("make_graphed_callables: sample_kwargs is not supported (pass inputs "
                                  "positionally in sample_args; is_first_microbatch is a replay argument)")
    if _order is not None:
        raise NotImplementedError("make_graphed_callables: _order (pipeline-parallel interleaving) is not supported")
    if retain_graph_in_backward:
        raise NotImplementedError("make_graphed_callables: retain_graph_in_backward is not supported")
    if fp8_calibrating:
        raise NotImplementedError("make_graphed_callables: fp8_calibrating (FP8 calibration) is not implemented")
    if isinstance(fp8_enabled, tuple):
        if len(fp8_enabled) != len(callables) or not all(isinstance(e, bool) for e in fp8_enabled):
            raise ValueError(f"make_graphed_callables: fp8_enabled must be a bool or a tuple of {len(callables)} "
                             f"bools (one per callable), got {fp8_enabled!r}")
        enabled = fp8_enabled
    elif isinstance(fp8_enabled, bool):
        enabled = (fp8_enabled,) * len(callables)
    else:
        raise TypeError(f"make_graphed_callables: fp8_enabled must be a bool or a tuple of bools, got "
                        f"{type(fp8_enabled).__name__}")
    if not any(enabled):
        recipe = None
    else:
        recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        if not isinstance(recipe, Recipe):
            raise TypeError(f"make_graphed_callables: fp8_recipe must be a transformer_engine_c.recipe.Recipe, got "
                            f"{type(recipe).__name__}")
        reason = recipe.unsupported_reason()
        if reason:
            raise NotImplementedError(f"make_graphed_callables: fp8_recipe: {reason}")
        if fp8_weight_caching and isinstance(recipe, Float8BlockScaling):
            raise NotImplementedError("make_graphed_callables: fp8_weight_caching is not supported with "
                                      "Float8BlockScaling (its block cast has no noop flag)")
    for c, e in zip(callables, enabled):
        if (e or fp8_weight_caching) and not isinstance(c, torch.nn.Module):
            raise TypeError(f"make_graphed_callables: FP8 (fp8_enabled, fp8_weight_caching) graphs modules "
                            f"(torch.nn.Module), got {type(c).__name__}")
    return enabled, recipe


def _check_capturable(callable_):
    """Refuse, before anything runs, what the layers would refuse during
    capture (the same message, earlier and on every rank alike)."""
    if not isinstance(callable_, torch.nn.Module):
        return
    for name, m in callable_.named_modules():
        label = f"{type(m).__name__}{f' ({name})' if name else ''}"
        for pname, p in m.named_parameters(recurse=False):
            if getattr(p, "is_distributed_weight", False) and type(p) is not torch.nn.Parameter:
                raise RuntimeError(f"make_graphed_callables: {label}.{pname} is a DistributedWeight, whose "
                                   "gather cannot be captured in a CUDA graph")


# ------------------------------------------------------ the capture and replays


class _Capture:
    """A module's forward while torch warms it up and captures it: inside
    the FP8 autocast with _graph=True (no forward amax update at its exit),
    with the first-module flag taken (no layer runs the backward amax update
    inside the capture: the graphed callable does, after its backward graph)
    and the weight-caching flag visible to the layers only for a module
    captured with fp8_weight_caching. finish() installs the replay forward
    (_Replay) over torch's, or puts the module's own forward back."""

    def __init__(self, module, fp8, recipe, group, flag):
        self.module, self.fp8, self.group, self.flag = module, fp8, group, flag
        # a module without FP8 captures under autocast(enabled=False), as TE's; any recipe
        # will do there (a given one: the default would ask the device for its kind)
        self.recipe = recipe if recipe is not None else DelayedScaling()
        self.own = module.__dict__.get("forward")  # an instance attribute, or None: the class's
        self.orig = module.forward
        self.training = module.training
        module.forward = self.forward

    def forward(self, *args, **kwargs):
        with autocast(enabled=self.fp8, recipe=self.recipe, amax_reduction_group=self.group, _graph=True):
            _State.is_first_fp8_module()
            kept = _State.SKIP_FP8_WEIGHT_UPDATE
            _State.SKIP_FP8_WEIGHT_UPDATE = self.flag
            try:
                return self.orig(*args, **kwargs)
            finally:
                _State.SKIP_FP8_WEIGHT_UPDATE = kept

    def finish(self, captured):
        m = self.module
        if captured:  # torch's replaced ours: its graphed forward is what we replay
            m.forward = _Replay(m, m.forward, self.orig, self.training, self.fp8, self.flag)
        elif self.own is not None:
            m.forward = self.own
        else:
            del m.forward


class _Replay:
    """A graphed module's forward: TE's functionalized / Graphed around
    torch's graphed callable `graphed` (positional inputs). With the
    module's training mode of capture time: writes the weight-caching flag
    from is_first_microbatch, registers the FP8 layers' fp8_meta with the
    active autocast, replays, and, where this callable is the autocast's
    first FP8 module, updates the backward amaxes after its backward graph.
    In the other mode the module's own forward runs eagerly."""

    def __init__(self, module, graphed, orig, training, fp8, flag):
        self.module, self.graphed, self.orig, self.training, self.fp8, self.flag = (
            module, graphed, orig, training, fp8, flag)

    def __call__(self, *args, **kwargs):
        first_mb = kwargs.pop("is_first_microbatch", None)
        if self.module.training != self.training:
            if first_mb is not None:
                kwargs["is_first_microbatch"] = first_mb
            return self.orig(*args, **kwargs)
        if kwargs:
            raise TypeError(f"graphed {type(self.module).__name__}: keyword arguments {sorted(kwargs)} are not "
                            "supported (a graph takes its inputs positionally, and is_first_microbatch)")
        if self.flag is not None:
            self.flag.fill_(float(skip_weight_update(first_mb)))
        owner = False
        if self.fp8 and _State.is_fp8_enabled():
            register_fp8_metas(self.module)
            owner = _State.is_first_fp8_module()
        out = self.graphed(*args)
        if owner:
            after_backward(out, _update_backward_amaxes)
        return out


def skip_weight_update(is_first_microbatch):
    """The weight-caching flag's value for a replay: not
    is_first_microbatch, which must be a bool (TE's rule)."""
    if not isinstance(is_first_microbatch, bool):
        raise ValueError("graphed module with fp8_weight_caching: the is_first_microbatch boolean keyword "
                         f"argument must be given (True casts the weights, False reuses them), got "
                         f"{is_first_microbatch!r}")
    return not is_first_microbatch


def register_fp8_metas(module):
    """TE's replay step: every delayed-scaling fp8_meta of the module's
    layers takes the active autocast's recipe and group and is registered
    for its updates (once; the registration keeps views of its tensors)."""
    recipe = _State.get_fp8_recipe()
    if not isinstance(recipe, DelayedScaling):
        return
    group = _State.get_fp8_group()
    for m in module.modules():
        meta = m.__dict__.get("fp8_meta")
        if isinstance(meta, dict) and "scaling_fwd" in meta:
            meta["recipe"] = recipe
            meta["fp8_group"] = group
            _State.add_fp8_tensors_to_global_buffer(meta)


def _update_backward_amaxes():
    _State.reduce_and_update_fp8_tensors(forward=False)


def after_backward(out, fn):
    """Run fn() right after the backward of the autograd node that made
    `out` (the first tensor of it with a grad_fn; the graphed callable's
    node, so after its backward graph has replayed); nothing when no output
    has one (no backward will run)."""
    for t in (out,) if type(out) is torch.Tensor else _pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_hook(lambda grad_inputs, grad_outputs: fn())
            return


# --------------------------------------------- the fp8_meta around a capture

_META_KEYS = ("scaling_fwd", "scaling_bwd")


def _fp8_layers(callables):
    for c in callables:
        if isinstance(c, torch.nn.Module):
            for m in c.modules():
                if getattr(type(m), "_fp8_num_gemms", None):
                    yield m


def _meta_tensors(layer):
    meta = layer.__dict__.get("fp8_meta")
    if not isinstance(meta, dict) or "scaling_fwd" not in meta:
        return None
    return [t for k in _META_KEYS for t in (meta[k].scale, meta[k].scale_inv, meta[k].amax_history)]


def save_fp8_tensors(callables):
    """Copies of the delayed-scaling tensors (scale, scale_inv,
    amax_history; forward, backward) of every FP8 layer in `callables`
    (None for a layer without them yet), for restore_fp8_tensors."""
    saved = []
    for layer in _fp8_layers(callables):
        ts = _meta_tensors(layer)
        saved.append((layer, None if ts is None else [t.clone() for t in ts]))
    return saved


def restore_fp8_tensors(saved):
    """Put back, in place (the graphs hold their addresses), what
    save_fp8_tensors copied; a layer whose fp8_meta was made in between
    gets a fresh one's values (scales 1, histories 0), as its first eager
    FP8 call would."""
    for layer, old in saved:
        cur = _meta_tensors(layer)
        if cur is None:
            continue
        for i, t in enumerate(cur):
            if old is not None and old[i].shape == t.shape:
                t.copy_(old[i])
            elif i % 3 == 2:
                t.zero_()
            else:
                t.fill_(1.0)
