"""DistributedWeight: a weight stored sharded along dim 0 across a process group
(FSDP-style) and gathered on demand by the layers that use it.

    w = tec.DistributedWeight(local_shard, full_shape, group=dp_group)
    layer.weight = w                      # an nn.Parameter: optimizers see the shard
    full = w.materialize()                # all-gather (forward, and again in backward)
    w.reduce_grad(full_grad)              # reduce-scatter (SUM) into .grad / .main_grad

Decisions (docs/distributed_weight.md says more):

* It is a ``torch.nn.Parameter`` subclass made with ``Tensor._make_subclass``
  (as FSDP's flat parameters are), so it can be a layer's ``weight``: the
  module registers it, ``parameters()`` yields it, optimizers and
  ``state_dict()`` see the local shard ``[full_shape[0] / world, *full_shape[1:]]``.
  ``load_state_dict`` expects shards. Ordinary torch ops on it act on the shard
  and return plain tensors (as for ``nn.Parameter``).
* The full weight is never kept: every ``materialize()`` all-gathers again, so
  backward (and every checkpoint recomputation) gathers afresh.
* Gradients reach the shard through ``reduce_grad`` only: layers call it from
  backward (``module/_weights.weight_grad``) and return ``None`` to autograd
  for the weight. The reduction is a SUM over the group; scale the loss for a
  mean. It accumulates into ``main_grad`` when the attribute exists
  (Megatron-style fp32 buffers), else into ``.grad``.
* ``group=None`` means the default process group when ``torch.distributed`` is
  initialised and a single-process group (world size 1, no communication)
  otherwise; the shard and ``full_shape`` must agree with that world size.
* ``is_distributed_weight = True`` is what ``prepare_for_saving`` looks for: it
  keeps the object by reference so backward gets *this* object back under
  saved-tensor hooks, offloading and checkpointing.
* Under ``torch.compile`` any use raises (``__torch_function__`` and
  ``materialize`` check ``torch.compiler.is_compiling()``): the gather and the
  gradient routing are side effects that a traced graph would get wrong.
* A Float8Tensor shard (FP8 primary weights) makes a Float8DistributedWeight:
  a Float8Tensor parameter with the same gather / reduce methods, whose
  ``materialize()`` all-gathers the FP8 bytes with one scale for the whole
  weight (see that class).
"""
import copy

import torch
import torch.distributed as dist

from .distributed import all_gather_rows, reduce_scatter_rows
from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Tensor
from .tensor.quantized_tensor import QuantizedTensor

__all__ = ["DistributedWeight", "Float8DistributedWeight"]

_COMPILE_MSG = ("DistributedWeight cannot be used under torch.compile: its all-gather and gradient "
                "routing are not traceable; run the layers that own it eagerly "
                "(torch.compiler.disable) or use a plain weight")


def _check_not_compiling():
    if torch.compiler.is_compiling():
        raise RuntimeError(_COMPILE_MSG)


def _size_rank(group):
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    if group is not None:
        raise ValueError("DistributedWeight: a group was given but torch.distributed is not initialised")
    return 1, 0


def _check_shard(shard, full_shape, group):
    """(world size, rank, full shape) of a shard of dim-0 rows."""
    if not isinstance(shard, torch.Tensor):
        raise TypeError(f"DistributedWeight: shard must be a torch.Tensor, got {type(shard).__name__}")
    if shard.dim() < 1:
        raise ValueError("DistributedWeight: shard must have at least one dimension (sharded along dim 0)")
    world, rank = _size_rank(group)
    if full_shape is None:
        full_shape = (shard.shape[0] * world, *shard.shape[1:])
    full_shape = torch.Size(full_shape)
    if (len(full_shape) != shard.dim() or full_shape[1:] != shard.shape[1:]
            or full_shape[0] != shard.shape[0] * world):
        raise ValueError(f"DistributedWeight: a shard of shape {tuple(shard.shape)} on a group of {world} "
                         f"rank(s) does not make a weight of shape {tuple(full_shape)} (sharded along dim 0)")
    return world, rank, full_shape


def _reduce_grad(self, full_grad):
    """DistributedWeight.reduce_grad, for both kinds of shard."""
    _check_not_compiling()
    if not isinstance(full_grad, torch.Tensor) or full_grad.shape != self._dw_full_shape:
        got = tuple(full_grad.shape) if isinstance(full_grad, torch.Tensor) else type(full_grad).__name__
        raise ValueError(f"DistributedWeight.reduce_grad: expected a gradient of shape "
                         f"{tuple(self._dw_full_shape)}, got {got}")
    with torch._C.DisableTorchFunctionSubclass():
        full_grad = full_grad.detach()
        if self._dw_world_size == 1:
            g = full_grad
        else:
            g = reduce_scatter_rows(full_grad, self._dw_group, self._dw_world_size)
        main = getattr(self, "main_grad", None)
        if main is not None:
            main.add_(g)
        elif self.grad is None:
            self.grad = g.to(self.dtype, copy=g is full_grad)
        else:
            self.grad.add_(g)
    return g


class DistributedWeight(torch.nn.Parameter):
    """A parameter holding this rank's dim-0 shard of a weight of ``full_shape``.

    Args:
        shard: this rank's rows, ``[full_shape[0] // world_size, *full_shape[1:]]``
            (rank r holds rows ``r * n : (r + 1) * n``). Its storage is used as is.
        full_shape: shape of the whole weight; default: the shard's shape with
            dim 0 multiplied by the group's size.
        group: process group the weight is sharded over (see module docstring).
        requires_grad: as for ``nn.Parameter``.
    """

    is_distributed_weight = True

    def __new__(cls, shard, full_shape=None, group=None, requires_grad=True):
        if isinstance(shard, Float8Tensor):
            return Float8DistributedWeight(shard, full_shape, group, requires_grad)
        if isinstance(shard, QuantizedTensor):
            raise NotImplementedError(f"DistributedWeight: a {type(shard).__name__} shard is not supported (FP8 "
                                      "shards are Float8Tensor: per-tensor scaling)")
        world, rank, full_shape = _check_shard(shard, full_shape, group)
        self = torch.Tensor._make_subclass(cls, shard.detach(), requires_grad)
        self._dw_group = group
        self._dw_full_shape = full_shape
        self._dw_world_size = world
        self._dw_rank = rank
        self.gather_count = 0  # how many times materialize() ran (tests and debugging)
        return self

    @classmethod
    def from_full(cls, full, group=None, requires_grad=True):
        """Build from the full weight (identical on every rank): keep this rank's rows."""
        world, rank = _size_rank(group)
        if full.shape[0] % world:
            raise ValueError(f"DistributedWeight.from_full: dim 0 ({full.shape[0]}) is not divisible by the "
                             f"group size ({world})")
        n = full.shape[0] // world
        if isinstance(full, QuantizedTensor) and not isinstance(full, Float8Tensor):
            return cls(full, full.shape, group=group, requires_grad=requires_grad)  # refused, naming the type
        if isinstance(full, Float8Tensor):  # this rank's rows of the bytes, the one scale
            shard = Float8Tensor(shape=(n, *full.shape[1:]), dtype=full.dtype,
                                 data=full._data[rank * n:(rank + 1) * n].clone(),
                                 fp8_scale_inv=full._scale_inv.clone(), fp8_dtype=full._fp8_dtype,
                                 quantizer=full._quantizer, device=full.device)
        else:
            shard = full.detach()[rank * n:(rank + 1) * n].clone()
        return cls(shard, full.shape, group=group, requires_grad=requires_grad)

    # -- what it is ------------------------------------------------------------
    @property
    def full_shape(self):
        return self._dw_full_shape

    @property
    def group(self):
        return self._dw_group

    @property
    def world_size(self):
        return self._dw_world_size

    @property
    def shard_rank(self):
        return self._dw_rank

    # -- gather and reduce -------------------------------------------------------
    def materialize(self):
        """All-gather the full weight as a new plain tensor (not differentiable:
        gradients go back through :meth:`reduce_grad`)."""
        _check_not_compiling()
        self.gather_count += 1
        with torch._C.DisableTorchFunctionSubclass():
            shard = self.detach()
        if self._dw_world_size == 1:
            return shard
        return all_gather_rows(shard, self._dw_group, self._dw_world_size)

    def reduce_grad(self, full_grad):
        """Reduce-scatter (SUM over the group) the full weight's gradient to this
        rank's shard and accumulate it into ``main_grad`` if present, else ``.grad``.
        Returns the reduced shard gradient."""
        return _reduce_grad(self, full_grad)

    # -- Parameter plumbing ----------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _check_not_compiling()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch._C.DisableTorchFunctionSubclass():
            shard = self.detach().clone(memory_format=torch.preserve_format)
        # the group is shared, not copied (process groups cannot be copied)
        result = DistributedWeight.__new__(type(self), shard, self._dw_full_shape, self._dw_group,
                                           self.requires_grad)
        memo[id(self)] = result
        for k, v in self.__dict__.items():
            if k not in result.__dict__:
                setattr(result, k, copy.deepcopy(v, memo))
        return result

    def __reduce_ex__(self, proto):
        raise TypeError("DistributedWeight cannot be pickled (it refers to a process group); save "
                        "state_dict() (which holds the local shard) instead")

    def __repr__(self):
        with torch._C.DisableTorchFunctionSubclass():
            body = torch.Tensor.__repr__(self.detach())
        return (f"DistributedWeight(full_shape={tuple(self._dw_full_shape)}, world_size={self._dw_world_size}, "
                f"rank={self._dw_rank}) shard:\n{body}")


class Float8DistributedWeight(Float8Tensor):
    """A DistributedWeight whose shard is a Float8Tensor (FP8 primary
    weights sharded over a group); ``DistributedWeight(shard, ...)`` makes one
    for a Float8Tensor shard. It is a Float8Tensor parameter of the shard
    (``_data``, ``_scale_inv``, ``_quantizer``; optimizers update it in place,
    ``state_dict`` holds the shard) with DistributedWeight's ``full_shape``,
    ``group``, ``world_size``, ``shard_rank``, ``gather_count``,
    ``materialize()`` and ``reduce_grad()``.

    One scale for the whole weight: a current-scaling shard's quantizer is
    given the group as its amax-reduction group, so every in-place update
    casts every shard with the group's amax and the ranks agree on the scale.
    ``materialize()`` all-gathers, in one collective, each rank's FP8 bytes
    with its scale_inv appended (4 bytes), and returns the full weight as a
    Float8Tensor of the gathered bytes and that scale. Where the ranks'
    scales differ (delayed scaling whose amax histories are not reduced over
    this group, a shard loaded from elsewhere) the gathered rows are
    re-scaled to the largest scale_inv on every rank alike, so all ranks
    still hold the same full weight; ``rescaled_gathers`` counts those."""

    is_distributed_weight = True

    @staticmethod
    def __new__(cls, shard, full_shape=None, group=None, requires_grad=True):
        world, rank, full_shape = _check_shard(shard, full_shape, group)
        if shard._data is None:
            raise ValueError("DistributedWeight: a Float8Tensor shard needs its rowwise data")
        self = Float8Tensor.__new__(cls, shape=shard.shape, dtype=shard.dtype, data=shard._data,
                                    fp8_scale_inv=shard._scale_inv, fp8_dtype=shard._fp8_dtype,
                                    quantizer=_group_quantizer(shard._quantizer, group, world),
                                    requires_grad=requires_grad, device=shard.device)
        for k, v in getattr(shard, "__dict__", {}).items():  # TE's / Megatron's attributes
            if not k.startswith("_") or k in ("_high_precision_init_val",):
                setattr(self, k, v)
        self._is_param = True  # isinstance(self, nn.Parameter), as for torch's custom-tensor parameters
        self._dw_group = group
        self._dw_full_shape = full_shape
        self._dw_world_size = world
        self._dw_rank = rank
        self.gather_count = 0
        self.rescaled_gathers = 0
        return self

    full_shape = DistributedWeight.full_shape
    group = DistributedWeight.group
    world_size = DistributedWeight.world_size
    shard_rank = DistributedWeight.shard_rank

    def materialize(self):
        """The full weight as a Float8Tensor (not differentiable: gradients
        go back through reduce_grad), gathered in FP8 (see the class)."""
        _check_not_compiling()
        self.gather_count += 1
        world, data, si = self._dw_world_size, self._data, self._scale_inv
        full_shape = self._dw_full_shape
        if world == 1:
            full_data, full_si = data, si
        else:
            n = data.numel()
            mine = torch.cat([data.reshape(-1), si.reshape(1).view(torch.uint8)]).reshape(1, n + 4)
            got = all_gather_rows(mine, self._dw_group, world)
            parts = got[:, :n]
            scales = got[:, n:].contiguous().view(torch.float32).reshape(world)
            full_si = scales.max().reshape(1)
            if bool((scales != full_si).any()):  # the ranks' scales differ: one scale for the whole weight
                self.rescaled_gathers += 1
                vals = parts.view(self._fp8_dtype).float() * (scales / full_si).reshape(world, 1)
                parts = vals.to(self._fp8_dtype).view(torch.uint8)
            full_data = parts.reshape(full_shape)
        return Float8Tensor(shape=full_shape, dtype=self.dtype, data=full_data, fp8_scale_inv=full_si.clone(),
                            fp8_dtype=self._fp8_dtype, device=self.device)

    def reduce_grad(self, full_grad):
        """As DistributedWeight.reduce_grad."""
        return _reduce_grad(self, full_grad)

    def __reduce_ex__(self, proto):
        raise TypeError("DistributedWeight cannot be pickled (it refers to a process group); save "
                        "state_dict() (which holds the local shard) instead")

    def __repr__(self, *, tensor_contents=None):
        return (f"Float8DistributedWeight(full_shape={tuple(self._dw_full_shape)}, world_size={self._dw_world_size}, "
                f"rank={self._dw_rank}, fp8_dtype={self._fp8_dtype}, scale_inv={self._scale_inv.item()})")


def _group_quantizer(quantizer, group, world):
    """The shard's quantizer, a current-scaling one reducing its amax over
    the weight's group (so that the shards share one scale)."""
    if world > 1 and isinstance(quantizer, Float8CurrentScalingQuantizer) and not quantizer.with_amax_reduction:
        q = quantizer.copy()
        q.with_amax_reduction, q.amax_reduction_group = True, group
        return q
    return quantizer
