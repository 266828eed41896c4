"""Tensor-parallel plumbing over torch.distributed: group resolution and the
non-overlapped sequence-parallel collectives (along the first dimension of a
2-D token-major tensor)."""
import torch
import torch.distributed as dist

# PyTorch 2.13 renamed the flat collectives; older releases have only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    work = _all_gather_flat(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(x, group, size):
    """[size * T, H] partial sums on each rank -> this rank's [T, H] of the sum."""
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {x.shape[0]} rows over {size} ranks")
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, x.contiguous(), group=group)
    return out


def all_reduce(x, group, size):
    if size > 1:
        dist.all_reduce(x, group=group)
    return x
