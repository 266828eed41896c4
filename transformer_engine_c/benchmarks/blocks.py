"""The GPT-style pre-LN block the benchmarks time: the same block of torch.nn
modules (TorchBlock) and of the package's layers (OurBlock), its attention
half of torch.nn modules (TorchAttention), its geometry for a TOKENSxHIDDEN
shape, and one training step of it. --compile times the two blocks
(benchmarks/compile.py), --tp1 compares them, MultiheadAttention and
TransformerLayer (benchmarks/tp1.py), --fp8 --host profiles ours
(benchmarks/fp8_host.py).
"""
import torch
import torch.nn.functional as F


def geometry(tokens, hidden):
    """(sequence, batch, heads) of a TOKENSxHIDDEN shape."""
    seq = min(tokens, 2048)
    if tokens % seq:
        raise ValueError(f"tokens {tokens} is not a multiple of the sequence length {seq}")
    heads = hidden // 128 if hidden >= 256 else 2
    return seq, tokens // seq, heads


def torch_attention(m, x):
    """The attention half of a torch.nn block m (ln1, qkv, heads, proj): proj(causal attention(qkv(ln1(x))))."""
    s, b, h = x.shape
    q, k, v = m.qkv(m.ln1(x)).view(s, b, 3, m.heads, -1).permute(2, 1, 3, 0, 4).unbind(0)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, h)
    return m.proj(a)


class TorchAttention(torch.nn.Module):
    """The attention half of TorchBlock: nn.LayerNorm, one qkv nn.Linear,
    causal F.scaled_dot_product_attention, nn.Linear proj (no residual), the
    modules named as TorchBlock's."""

    def __init__(self, hidden, heads, dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.heads = heads
        self.ln1, self.qkv = torch.nn.LayerNorm(hidden, **kw), torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)

    def forward(self, x):
        return torch_attention(self, x)


class TorchBlock(torch.nn.Module):
    """The block of torch.nn modules (ffn: the MLP's hidden size, 4 x hidden
    unless given). Input and output are [s, b, hidden]; the qkv Linear's
    output is [q heads | k heads | v heads]."""

    def __init__(self, hidden, heads, dtype, device, ffn=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        ffn = 4 * hidden if ffn is None else ffn
        self.heads = heads
        self.ln1, self.qkv = torch.nn.LayerNorm(hidden, **kw), torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)
        self.ln2, self.fc1 = torch.nn.LayerNorm(hidden, **kw), torch.nn.Linear(hidden, ffn, **kw)
        self.fc2 = torch.nn.Linear(ffn, hidden, **kw)

    def forward(self, x):
        x = x + torch_attention(self, x)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class OurBlock(torch.nn.Module):
    """The block of the package's layers (ffn as TorchBlock's)."""

    def __init__(self, tec, hidden, heads, dtype, device, ffn=None):
        super().__init__()
        kw = dict(params_dtype=dtype, device=device)
        self.heads = heads
        self.qkv = tec.LayerNormLinear(hidden, 3 * hidden, **kw)
        self.attn = tec.DotProductAttention(heads, hidden // heads, attn_mask_type="causal")
        self.proj = tec.Linear(hidden, hidden, **kw)
        self.mlp = tec.LayerNormMLP(hidden, 4 * hidden if ffn is None else ffn, **kw)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, -1).unbind(2)
        x = x + self.proj(self.attn(q, k, v).view(s, b, h))
        return x + self.mlp(x)


def copy_into(ours, ref):
    """ref's parameters take ours' values (the blocks compute the same function)."""
    pairs = (("ln1", ours.qkv, "layer_norm_"), ("qkv", ours.qkv, ""), ("proj", ours.proj, ""),
             ("ln2", ours.mlp, "layer_norm_"), ("fc1", ours.mlp, "fc1_"), ("fc2", ours.mlp, "fc2_"))
    with torch.no_grad():
        for name, layer, prefix in pairs:
            for kind in ("weight", "bias"):
                getattr(getattr(ref, name), kind).copy_(getattr(layer, prefix + kind))


def twin(tec, ours, hidden, heads, dtype, device):
    """Another of our blocks with ours' parameter values."""
    t = OurBlock(tec, hidden, heads, dtype, device)
    t.load_state_dict(ours.state_dict())
    return t


def step(m, x, dy, tec=None, recipe=None):
    """One forward+backward of m (under an FP8 autocast of `recipe`). The
    gradients are dropped first, as a training step's optimizer.zero_grad
    drops them: accumulating into a gradient that a replay of PyTorch's CUDA
    graphs produced reads memory the next replay overwrites."""
    params = list(m.parameters())

    def run():
        x.grad = None
        for p in params:
            p.grad = None
        if recipe is None:
            y = m(x)
        else:
            with tec.autocast(enabled=True, recipe=recipe):
                y = m(x)
        y.backward(dy)
    return run
