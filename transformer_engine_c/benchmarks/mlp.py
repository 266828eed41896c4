"""The benchmark's MLP baselines (used by benchmarks/overlap.py for the
mlp rows): PyTorch's own tensor-parallel MLP block, and with --graphs the
CUDA-graphed steps (ours without userbuffers overlap, PyTorch's block).

TorchTPMLP is the block a PyTorch user writes by hand under sequence
parallelism: layer_norm -> all_gather_into_tensor (sequence) -> matmul
(column shard) -> gelu (tanh) -> matmul (row shard) -> reduce_scatter_tensor,
with torch autograd (the two collectives swap roles in the backward).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

# What a PyTorch user calls: all_gather_into_tensor / reduce_scatter_tensor, renamed
# all_gather_single / reduce_scatter_single in PyTorch 2.13 (the old names warn per call).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """all_gather_into_tensor along the sequence; backward reduce_scatter_tensor."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_flat(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """reduce_scatter_tensor along the sequence; backward all_gather_into_tensor."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, dy):
        size = dist.get_world_size(ctx.group)
        out = torch.empty((dy.shape[0] * size,) + tuple(dy.shape[1:]), dtype=dy.dtype, device=dy.device)
        all_gather_flat(out, dy.contiguous(), group=ctx.group)
        return out, None


def _reduce_scatter(x, group):
    size = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x.contiguous(), group=group)
    return out


class TorchTPMLP(torch.nn.Module):
    """PyTorch's tensor-parallel MLP block with sequence parallelism, for TP
    group `group`: input and output are this rank's (tokens / tp, hidden)
    rows; fc1 holds n / tp output columns, fc2 the matching input columns
    (its bias added once, after the reduce-scatter, as Megatron does)."""

    def __init__(self, hidden, n, group, dtype, device):
        super().__init__()
        size = dist.get_world_size(group)
        if n % size:
            raise ValueError(f"TorchTPMLP: n={n} must divide by the TP size {size}")
        self.group = group
        self.norm = torch.nn.LayerNorm(hidden, dtype=dtype, device=device)
        self.fc1 = torch.nn.Linear(hidden, n // size, dtype=dtype, device=device)
        self.fc2 = torch.nn.Linear(n // size, hidden, bias=False, dtype=dtype, device=device)
        self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))

    def forward(self, x):
        total = _GatherSequence.apply(self.norm(x), self.group)
        h = F.gelu(self.fc1(total), approximate="tanh")
        return _ReduceScatterSequence.apply(self.fc2(h), self.group) + self.fc2_bias


def torch_mlp_fns(hidden, n, group, dtype, device, x, dy, graphs):
    """{"torch_mlp"} (and with graphs {"torch_mlp_graphed"}): PyTorch's block,
    forward + backward of x (this rank's rows) with gradient dy; the graphed
    one captured by torch.cuda.make_graphed_callables (NCCL collectives
    capture on CUDA)."""
    block = TorchTPMLP(hidden, n, group, dtype, device)
    fns = {"torch_mlp": lambda: block(x).backward(dy)}
    if graphs:
        graphed_block = TorchTPMLP(hidden, n, group, dtype, device)
        graphed = torch.cuda.make_graphed_callables(graphed_block, (x,))
        fns["torch_mlp_graphed"] = lambda: graphed(x).backward(dy)
    return fns


class _TwoLayerMLP(torch.nn.Module):
    """Our mlp step as one module (what the graph captures): fc1 -> gelu -> fc2."""

    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def ours_graphed_fns(tec, fc1, fc2, x, dy, name):
    """{name}: our two layers (with or without ub_* flags) captured by
    tec.make_graphed_callables, forward + backward."""
    graphed = tec.make_graphed_callables(_TwoLayerMLP(fc1, fc2), (x,))
    return {name: lambda: graphed(x).backward(dy)}


GRAPH_NOTE = ("graphed variants (--graphs, CUDA only): ours_graphed_overlap captures the userbuffers "
              "handshakes too, on the communicators the eager overlapped step uses")
