"""Tensor-parallel plumbing over torch.distributed: group resolution and the
non-overlapped sequence-parallel collectives (along the first dimension of a
2-D token-major tensor)."""
import torch
import torch.distributed as dist

# The layers' collectives call the process group's own methods: torch.distributed's
# functions add their Python (argument checks, group lookups, logging wrappers) on
# top of them: 1-2.5 µs per call with NCCL on an H200 host, 15-30 µs with gloo on a
# small CPU (scripts/experiments/collective_host_cost.py). Only groups this rank
# belongs to reach here (resolve_tp). A group without the methods takes
# torch.distributed's functions; PyTorch 2.13 renamed the flat ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _process_group(group):
    """The ProcessGroup object behind `group` (None: the default group), if it
    has the methods the direct calls use."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg if hasattr(pg, "_allgather_base") and hasattr(pg, "_reduce_scatter_base") else None


def _all_gather_into(out, x, group, async_op):
    pg = _process_group(group)
    if pg is None:
        return _all_gather_flat(out, x, group=group, async_op=async_op)
    work = pg._allgather_base(out, x)
    if async_op:
        return work
    work.wait()
    return None


def _reduce_scatter_into(out, x, group):
    pg = _process_group(group)
    if pg is None:
        _reduce_scatter_flat(out, x, group=group)
    else:
        pg._reduce_scatter_base(out, x).wait()  # the default options: SUM


def resolve_tp(tp_group, tp_size):
    """(group, size, rank) of the tensor-parallel group; checks that an
    explicit tp_size agrees with the group."""
    if tp_group is None:
        if tp_size not in (None, 1):
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"tp_size={tp_size} needs tp_group (or an initialised default "
                                 "process group of that size)")
            if dist.get_world_size() != tp_size:
                raise ValueError(f"tp_size={tp_size} but no tp_group was given and the default "
                                 f"group has {dist.get_world_size()} ranks")
            return dist.group.WORLD, tp_size, dist.get_rank()
        return None, 1, 0
    size = dist.get_world_size(tp_group)
    if tp_size not in (None, 1, size):
        raise ValueError(f"tp_size={tp_size} does not match tp_group, which has {size} ranks")
    return tp_group, size, dist.get_rank(tp_group)


def all_gather_rows(x, group, size, async_op=False):
    """[T, H] on each rank -> [size * T, H], rank-major. With async_op,
    returns (out, work): out is valid after work.wait() (work None if there
    was nothing to wait for)."""
    if size == 1:
        return (x, None) if async_op else x
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather_into(out, x.contiguous(), group, async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(x, group, size):
    """[size * T, H] partial sums on each rank -> this rank's [T, H] of the sum."""
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {x.shape[0]} rows over {size} ranks")
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, x.contiguous(), group)
    return out


def all_reduce(x, group, size):
    if size > 1:
        pg = _process_group(group)
        if pg is None:
            dist.all_reduce(x, group=group)
        else:
            pg.allreduce([x]).wait()  # the default options: SUM
    return x


def allreduce_sequence_parallel_grads(*modules):
    """Sum, over each layer's tensor-parallel group, the gradients of the
    parameters that carry `sequence_parallel = True` (norm weights and
    biases, a row layer's bias): under sequence parallelism each rank's
    gradient of those is a partial sum over its own tokens. This is the step
    Megatron's finalize_model_grads runs for TransformerEngine layers; call
    it after backward (and before the optimizer) in other training loops,
    with the model (or several modules).
    One all-reduce per group, of all such gradients flattened together
    (collective: every rank of a group must hold the same gradients)."""
    by_group, seen = {}, set()
    for m in (sub for module in modules for sub in module.modules()):
        tp = getattr(m, "tp", None)
        if tp is None or getattr(tp, "size", 1) == 1:
            continue
        for p in m.parameters(recurse=False):
            if getattr(p, "sequence_parallel", False) and p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                by_group.setdefault(id(tp.group), (tp.group, []))[1].append(p.grad)
    for group, grads in by_group.values():
        all_reduce_coalesced(grads, group)


def all_reduce_coalesced(tensors, group, dtype=None):
    """Sum each of `tensors` in place over `group` in one all-reduce of them
    flattened together (in `dtype` when given, e.g. float32 for 16-bit
    gradients; else torch's promotion of theirs)."""
    flat = torch.cat([t.reshape(-1) if dtype is None else t.reshape(-1).to(dtype) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
