"""tec.make_graphed_callables: TransformerEngine's signature over PyTorch's
torch.cuda.make_graphed_callables, for this package's layers.

The layers capture as they are: every engine call (norm, activation, GEMM)
is enqueued on the current stream with workspaces from PyTorch's allocator,
so a graphed forward+backward replays the same kernels on the same memory.
Userbuffers overlap captures too: the handshakes take their epochs from
device memory when they run and advance them there, so a graph replays any
number of times, and several graphs and eager calls share a communicator
(docs/architecture.md, "CUDA graphs"). One feature cannot be replayed and is
refused: DistributedWeight (its gather is a collective issued per call; the
layers refuse it under capture). make_graphed_callables checks for it
before it captures, naming the layer. FP8 arguments raise
NotImplementedError.
"""
import torch

__all__ = ["make_graphed_callables"]


def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           sample_kwargs=None, fp8_enabled=False, fp8_calibrating=False, fp8_recipe=None,
                           fp8_group=None, fp8_weight_caching=False, _order=None, pool=None,
                           retain_graph_in_backward=False):
    """Capture `modules` (a callable or a tuple of them) with `sample_args`
    (a tuple of inputs, or a tuple of such tuples) into CUDA graphs for
    forward and backward; returns graphed callables as
    torch.cuda.make_graphed_callables does. TE's arguments: the FP8 ones must
    be off, `sample_kwargs` empty, `_order` (pipeline-parallel interleaving)
    None and `retain_graph_in_backward` False; each raises otherwise."""
    if fp8_enabled or fp8_calibrating or fp8_weight_caching:
        raise NotImplementedError("make_graphed_callables: FP8 (fp8_enabled, fp8_calibrating, "
                                  "fp8_weight_caching) is not supported")
    if sample_kwargs and any(sample_kwargs if isinstance(sample_kwargs, dict) else sample_kwargs):
        raise NotImplementedError("make_graphed_callables: sample_kwargs is not supported (pass inputs "
                                  "positionally in sample_args)")
    if _order is not None:
        raise NotImplementedError("make_graphed_callables: _order (pipeline-parallel interleaving) is not supported")
    if retain_graph_in_backward:
        raise NotImplementedError("make_graphed_callables: retain_graph_in_backward is not supported")
    for m in modules if isinstance(modules, tuple) else (modules,):
        _check_capturable(m)
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs a CUDA device (CUDA graphs)")
    return torch.cuda.make_graphed_callables(modules, sample_args, num_warmup_iters=num_warmup_iters,
                                             allow_unused_input=allow_unused_input, pool=pool)


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
