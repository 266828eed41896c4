"""TransformerEngine's rotary position embedding (`attention.rope`):
`RotaryPositionEmbedding` makes the angle table, `apply_rotary_pos_emb`
rotates the first d2 channels of each head of q or k by it.

Angles: `freqs` [s2, 1, 1, d2] float32, row p the angles of position p. Each
pair of channels (i, i + d2/2), or (2i, 2i + 1) with `interleaved`, turns by
its angle: out = x * cos(f) + rotate(x) * sin(f), where rotate(x) of a pair
(a, b) is (-b, a). Channels past d2 pass through unchanged.

`fused=True` is one engine call each way (tec_rope: csrc/core/cpu/rope.c,
csrc/core/cuda/rope.cu), reading q/k in place through their strides and
computing in float32; `fused=False` is the same arithmetic in PyTorch ops
(cos and sin rounded to the input's dtype first, as TE's unfused path).
Formats sbhd, bshd and thd (sequences packed along the first dimension,
delimited by `cu_seqlens`) in both. Positions: a token's index in its
sequence, plus `start_positions[i]` for sequence i (inference), or, under
context parallelism (cp_size > 1), the position in the whole sequence of
this rank's two chunks (chunk cp_rank and chunk 2 * cp_size - 1 - cp_rank,
the load-balanced split). Exercised by tests/test_rope.py."""
import torch

from .. import _engine, _library

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "apply_fused_qkv_rotary_pos_emb"]

FORMATS = ("sbhd", "bshd", "thd")


class _KeptTable:
    """RotaryPositionEmbedding's last table and what it was made from."""

    __slots__ = ("key", "inv", "inv_version", "table", "version")

    def __init__(self, key, inv, table):
        self.key, self.inv, self.inv_version = key, inv, inv._version
        self.table, self.version = table, table._version


class RotaryPositionEmbedding(torch.nn.Module):
    """The angle table of RoPE: forward(max_seq_len, offset=0) returns
    freqs [max_seq_len, 1, 1, 2 * ceil(dim' / 2)] (float32), dim' =
    int(dim * rotary_percent), row p the angles of position p + offset:
    p / rotary_base ** (2j / dim') for channel pair j. Linear position
    interpolation, as TE: with both seq_len_interpolation_factor and
    pretrained_max_position_embeddings, positions are divided by the factor,
    or, for a max_seq_len beyond pretrained * factor, scaled by
    pretrained / max_seq_len (the factor alone changes nothing). The table
    is computed in float32 outside autocast. `interleaved` lays the angles out for
    apply_rotary_pos_emb(interleaved=True): f0 f0 f1 f1 ... rather than
    f0 f1 ... f0 f1 .... The last table is kept (a model asks for the same one
    every step) and returned again while its arguments, the attributes it
    is made from, inv_freq (the same tensor, not changed in place) and the
    table itself (not changed in place) are the same; not under
    torch.compile, and not in a CUDA graph capture (the graph must own the
    table it reads)."""

    def __init__(self, dim, rotary_percent=1.0, seq_len_interpolation_factor=None,
                 pretrained_max_position_embeddings=None, rotary_base=10000.0, interleaved=False):
        super().__init__()
        if not 0.0 < float(rotary_percent) <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim < 2:
            raise ValueError(f"RotaryPositionEmbedding: the rotary dimension ({dim}) must be at least 2")
        self.dim = dim
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = bool(interleaved)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (float(rotary_base) ** exponents))

    def forward(self, max_seq_len, offset=0):
        inv = self.inv_freq
        # not in a CUDA graph capture: the graph must own the table it reads (a kept one could be freed after)
        keep = (type(max_seq_len) is int and type(offset) is int and not inv.requires_grad and not inv.is_inference()
                and not torch.compiler.is_compiling()
                and not (inv.is_cuda and torch.cuda.is_current_stream_capturing()))
        if keep:
            key = (max_seq_len, offset, self.seq_len_interpolation_factor, self.pretrained_max_position_embeddings,
                   self.interleaved)
            kept = self.__dict__.get("_kept_table")
            if (kept is not None and kept.key == key and kept.inv is inv and kept.inv_version == inv._version
                    and kept.table._version == kept.version):
                return kept.table
        table = self._table(inv, max_seq_len, offset)
        if keep and not table.is_inference():
            self.__dict__["_kept_table"] = _KeptTable(key, inv, table)
        return table

    def _table(self, inv, max_seq_len, offset):
        with torch.autocast(device_type=inv.device.type, enabled=False):
            pos = torch.arange(max_seq_len, device=inv.device, dtype=torch.float32) + offset
            factor = self.seq_len_interpolation_factor
            if factor is not None:
                pretrained = self.pretrained_max_position_embeddings
                if pretrained is not None and max_seq_len > pretrained * factor:
                    pos = pos * (pretrained / max_seq_len)
                elif pretrained is not None:
                    pos = pos / factor
            angles = torch.outer(pos, inv.float())
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((angles, angles), dim=-1)
        return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])


def _rotate(x, interleaved):
    """(-b, a) for every channel pair (a, b) of x's last dimension."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((-b, a), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rotate_by(t, angles, interleaved):
    """t [..., d] with angles broadcastable to [..., d2] (float32)."""
    d2 = angles.shape[-1]
    cos, sin = torch.cos(angles).to(t.dtype), torch.sin(angles).to(t.dtype)
    head, tail = t[..., :d2], t[..., d2:]
    head = head * cos + _rotate(head, interleaved) * sin
    return torch.cat((head, tail), dim=-1) if tail.shape[-1] else head


def _local_positions(n, cp_size, cp_rank, device):
    """Positions of this rank's n tokens of a sequence (the whole sequence's,
    under context parallelism)."""
    idx = torch.arange(n, device=device)
    if cp_size == 1:
        return idx
    half = n // 2
    whole = n * cp_size
    return torch.where(idx < half, cp_rank * half + idx, whole - (cp_rank + 1) * half + (idx - half))


def _unfused(t, freqs, fmt, start_positions, interleaved, cu_seqlens, cp_size, cp_rank):
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    if fmt == "thd":
        lens = (torch.diff(cu_seqlens) // cp_size).tolist()
        pieces = []
        for i, piece in enumerate(torch.split(t, lens)):
            pos = _local_positions(piece.shape[0], cp_size, cp_rank, t.device)
            if start_positions is not None:
                pos = pos + start_positions[i]
            _check_rows(pos, table)
            pieces.append(_rotate_by(piece, table[pos].unsqueeze(1), interleaved))
        return torch.cat(pieces) if pieces else t.clone()
    s = t.shape[0] if fmt == "sbhd" else t.shape[1]
    pos = _local_positions(s, cp_size, cp_rank, t.device)  # [s]
    if start_positions is not None:
        pos = pos.unsqueeze(1) + start_positions.to(pos.device).view(1, -1)  # [s, b]
    else:
        pos = pos.unsqueeze(1)  # [s, 1]
    _check_rows(pos, table)
    angles = table[pos].unsqueeze(2)  # [s, b or 1, 1, d2]
    if fmt == "bshd":
        angles = angles.transpose(0, 1)
    return _rotate_by(t, angles, interleaved)


def _check_rows(pos, table):
    if pos.numel() and int(pos.max()) >= table.shape[0]:
        raise ValueError(f"apply_rotary_pos_emb: position {int(pos.max())} is past the {table.shape[0]} rows of "
                         "freqs")


def _rope(*args, backward=False):
    """The engine's RoPE: straight to it eagerly, through its registered
    operator while torch.compile traces (transformer_engine_c/_library.py)."""
    if torch.compiler.is_compiling():
        return _library.rope_op(*args, backward)
    return _engine.rope(*args, backward=backward)


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank):
        out = _rope(t, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank)
        ctx.save_for_backward(freqs, cu_seqlens, start_positions)
        ctx.args = (fmt, interleaved, cp_size, cp_rank)
        return out

    @staticmethod
    def backward(ctx, dy):
        freqs, cu_seqlens, start_positions = ctx.saved_tensors
        fmt, interleaved, cp_size, cp_rank = ctx.args
        dx = _rope(dy, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward=True)
        return dx, None, None, None, None, None, None, None


def _check(t, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank):
    if fmt not in FORMATS:
        raise ValueError(f"apply_rotary_pos_emb: tensor_format must be one of {FORMATS}, got {fmt!r}")
    if not isinstance(t, torch.Tensor) or t.dim() != (3 if fmt == "thd" else 4):
        raise ValueError(f"apply_rotary_pos_emb: t must be {3 if fmt == 'thd' else 4}-D in {fmt}, got "
                         f"{tuple(getattr(t, 'shape', ()))}")
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError("apply_rotary_pos_emb: freqs must be [s2, 1, 1, d2] (RotaryPositionEmbedding's output), "
                         f"got {tuple(getattr(freqs, 'shape', ()))}")
    d2 = freqs.shape[-1]
    if d2 % 2 or d2 == 0 or d2 > t.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: freqs' last dimension ({d2}) must be even, positive and at most "
                         f"the head size ({t.shape[-1]})")
    if int(cp_size) < 1 or not 0 <= int(cp_rank) < int(cp_size):
        raise ValueError(f"apply_rotary_pos_emb: cp_rank={cp_rank} with cp_size={cp_size}")
    if cp_size > 1 and start_positions is not None:
        raise ValueError("apply_rotary_pos_emb: start_positions cannot be combined with cp_size > 1")
    if fmt == "thd":
        if cu_seqlens is None:
            raise ValueError("apply_rotary_pos_emb: tensor_format='thd' needs cu_seqlens")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype.is_floating_point \
                or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"apply_rotary_pos_emb: cu_seqlens must be an integer tensor, got "
                            f"{type(cu_seqlens).__name__} {getattr(cu_seqlens, 'dtype', '')}".rstrip())
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"apply_rotary_pos_emb: cu_seqlens must be 1-D [b + 1], got {tuple(cu_seqlens.shape)}")
    elif cp_size > 1 and (t.shape[0 if fmt == "sbhd" else 1] % 2):
        raise ValueError("apply_rotary_pos_emb: under context parallelism each rank's sequence is two equal chunks "
                         f"(an even length), got {t.shape[0 if fmt == 'sbhd' else 1]}")
    nseq = (cu_seqlens.numel() - 1) if fmt == "thd" else t.shape[1 if fmt == "sbhd" else 0]
    if start_positions is not None and tuple(start_positions.shape) != (nseq,):
        raise ValueError(f"apply_rotary_pos_emb: start_positions must be [{nseq}] (one per sequence), got "
                         f"{tuple(start_positions.shape)}")


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=False,
                         cu_seqlens=None, cp_size=1, cp_rank=0):
    """TE's apply_rotary_pos_emb (arguments in TE's order): t [s, b, h, d],
    [b, s, h, d] or [t, h, d] (thd, with cu_seqlens [b + 1]; under context
    parallelism the whole sequences' cu_seqlens, each rank holding
    1/cp_size of every sequence); freqs [s2, 1, 1, d2], d2 <= d. Returns a
    new tensor of t's shape and dtype (contiguous with fused=True)."""
    _check(t, freqs, tensor_format, interleaved, cu_seqlens, start_positions, cp_size, cp_rank)
    if fused:
        return _FusedRoPE.apply(t, freqs, tensor_format, bool(interleaved), cu_seqlens, start_positions,
                                int(cp_size), int(cp_rank))
    return _unfused(t, freqs, tensor_format, start_positions, bool(interleaved), cu_seqlens, int(cp_size),
                    int(cp_rank))


def apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                                   start_positions=None, interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """TE's RoPE of a packed qkv [s, b, h, q + k + v] (or bshd), split along
    the last dimension by qkv_split_arg_list = [q, k, v] channels: returns
    (query [s, b, h * q / k, k] rotated by q_freqs, key [s, b, h, k] rotated
    by k_freqs, value [s, b, h, v]); the head size is the key's. Two engine
    calls (query, key), each reading its part of qkv in place; sbhd and bshd
    only, as TE; cu_seqlens is accepted and unused, as in TE."""
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"apply_fused_qkv_rotary_pos_emb: tensor_format must be 'sbhd' or 'bshd', got "
                         f"{tensor_format!r}")
    sizes = [int(n) for n in qkv_split_arg_list]
    if len(sizes) != 3 or qkv.dim() != 4 or sum(sizes) != qkv.shape[-1] or sizes[1] <= 0 or sizes[0] % sizes[1]:
        raise ValueError(f"apply_fused_qkv_rotary_pos_emb: qkv_split_arg_list {qkv_split_arg_list} must be "
                         f"[q, k, v] channels adding up to qkv's last dimension ({tuple(qkv.shape)}), q a multiple "
                         "of k")
    q, k, v = torch.split(qkv, sizes, dim=-1)
    q = q.reshape(*q.shape[:2], -1, sizes[1])
    kw = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved, fused=True,
              cp_size=cp_size, cp_rank=cp_rank)
    return apply_rotary_pos_emb(q, q_freqs, **kw), apply_rotary_pos_emb(k, k_freqs, **kw), v
