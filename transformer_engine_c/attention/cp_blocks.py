"""The attention of one block pair of context parallelism, with its
log-sum-exp, and the exact merge of partial results by it
(attention/context_parallel.py runs the exchanges around these).
`block_forward` / `block_backward`: PyTorch's flash kernel (CPU; CUDA in
bf16/fp16) where a block has no mask or the square causal one and equal
query and value head sizes, else float32 arithmetic over row tiles; the
backward recomputes probabilities from the merged log-sum-exp. Exercised by
tests/test_cp_kernel.py and tests/distributed/run_cp.py."""

import torch

_TILE_ELEMENTS = 1 << 22  # score elements per tile of block_forward / block_backward

_stats = {"p2p_steps": 0, "p2p_overlapped": 0, "all_gather": 0, "a2a": 0, "fused_blocks": 0, "math_blocks": 0}


def stats():
    """How many times each context-parallel path ran in this process:
    p2p_steps (ring steps, forward and backward), p2p_overlapped (steps whose
    attention ran while a message was in flight), all_gather, a2a, and the
    blocks whose forward ran PyTorch's flash kernel (fused_blocks) or float32
    arithmetic (math_blocks)."""
    return dict(_stats)


def reset_stats():
    for key in _stats:
        _stats[key] = 0


class PositionMask:
    """A block's mask from where its tokens sit: query i may see key j when
    both are tokens of the same sequence (`sid`, `valid`; None: one
    sequence, no padding) and j's position is within i's causal diagonal and
    window. Built a few query rows at a time (`rows`), never whole."""
    __slots__ = ("q_pos", "q_sid", "q_valid", "k_pos", "k_sid", "k_valid", "causal", "window")

    def __init__(self, q_pos, q_sid, k_pos, k_sid, causal, window, q_valid=None, k_valid=None):
        self.q_pos, self.q_sid, self.q_valid = q_pos, q_sid, q_valid
        self.k_pos, self.k_sid, self.k_valid = k_pos, k_sid, k_valid
        self.causal, self.window = causal, window

    def rows(self, a, z):
        """[z - a, Skv] True where query rows a..z-1 may see a key."""
        allowed = None

        def both(m):
            return m if allowed is None else allowed & m

        if self.q_sid is not None:
            allowed = both(self.q_sid[a:z].view(-1, 1) == self.k_sid.view(1, -1))
        if self.q_valid is not None:
            allowed = both(self.q_valid[a:z].view(-1, 1) & self.k_valid.view(1, -1))
        qp, kp = self.q_pos[a:z].view(-1, 1), self.k_pos.view(1, -1)
        left, right = self.window
        if self.causal:
            allowed = both(kp <= qp)
        elif right != -1:
            allowed = both(kp <= qp + right)
        if left != -1:
            allowed = both(kp >= qp - left)
        if allowed is None:
            allowed = torch.ones(z - a, kp.shape[1], dtype=torch.bool, device=kp.device)
        return allowed


def _tiles(rows, per_row):
    step = max(1, _TILE_ELEMENTS // max(1, per_row))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


CAUSAL = "causal"  # a block's mask: top-left causal over a square block


def _scores(qt, kf, scale, allowed):
    s = torch.matmul(qt, kf.transpose(-1, -2)).mul_(scale)
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s


def _mask_rows(mask, a, z, skv, device):
    """Rows a..z-1 of a block's mask (True: attend), or None (no mask)."""
    if mask is None:
        return None
    if isinstance(mask, str):  # CAUSAL: key j <= query i
        return torch.arange(skv, device=device).view(1, -1) <= torch.arange(a, z, device=device).view(-1, 1)
    if isinstance(mask, PositionMask):
        return mask.rows(a, z)
    return mask[a:z]


def _fused(q, v, mask):
    """Whether PyTorch's flash kernel serves this block: no mask or the
    square causal one, equal query and value head sizes; on CUDA bf16/fp16
    with a head size the kernel takes."""
    if not use_fused_blocks or not (mask is None or isinstance(mask, str)) or q.shape[-1] != v.shape[-1]:
        return False
    if q.is_cuda:
        return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    return q.device.type == "cpu"


use_fused_blocks = True  # False: every block in float32 arithmetic (block_forward's own path)


def _expand(t, g):
    """[B, Hk, S, D] -> [B, Hk * g, S, D], head h from key/value head h // g."""
    if g == 1:
        return t
    b, hk, s, d = t.shape
    return t.unsqueeze(2).expand(b, hk, g, s, d).reshape(b, hk * g, s, d)


def _keep(shape, dropout, a, device):
    """The kept elements (scaled by 1 / (1 - p)) of the dropout of a tile whose
    first row is `a`, or None without dropout: dropout = (p, the block's
    seed); the same arguments give the same draw, so the backward redraws
    what the forward drew."""
    if dropout is None:
        return None
    p, seed = dropout
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1000003 + a) % (1 << 63))
    keep = torch.rand(shape, generator=gen, device=device) >= p
    return keep.to(torch.float32).div_(1.0 - p)


def block_forward(q, k, v, scale, mask=None, dropout=None):
    """Attention of q [B, H, Sq, D] over k [B, Hk, Skv, D], v [B, Hk, Skv, Dv]
    (H a multiple of Hk: query head h uses key/value head h // (H / Hk)).
    `mask`: None (every key), CAUSAL (square block, top-left causal), a
    PositionMask, or a bool tensor [Sq, Skv] (True: attend). Returns the output [B, H, Sq, Dv]
    and the log-sum-exp of the scaled scores [B, H, Sq], both float32 (a row
    with no key: output 0, log-sum-exp -inf), and what block_backward needs
    of the kernel that ran. `dropout`: None, or (p, seed) to drop each
    probability with chance p (the log-sum-exp is that of the probabilities
    before dropout, so blocks merge as without it). PyTorch's flash kernel
    where _fused says (no dropout), else float32 arithmetic over row tiles."""
    b, h, sq, d = q.shape
    hk, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hk
    if dropout is None and _fused(q, v, mask):
        _stats["fused_blocks"] += 1
        qc, kc, vc = q.contiguous(), _expand(k, g).contiguous(), _expand(v, g).contiguous()
        causal = mask is not None
        if q.is_cuda:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qc, kc, vc, 0.0, causal, False, scale=scale)
            return res[0].float(), res[1].float(), tuple(res[2:8])
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qc, kc, vc, 0.0, causal, scale=scale)
        return o.float(), lse.float(), ()
    _stats["math_blocks"] += 1
    qf = q.reshape(b, hk, g, sq, d).float()
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    out = q.new_empty((b, hk, g, sq, dv), dtype=torch.float32)
    lse = q.new_empty((b, hk, g, sq), dtype=torch.float32)
    for a, z in _tiles(sq, b * h * skv):
        s = _scores(qf[..., a:z, :], kf, scale, _mask_rows(mask, a, z, skv, q.device))
        m = torch.logsumexp(s, dim=-1)
        p = s.sub_(torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1)).exp_()
        keep = _keep(p.shape, dropout, a, q.device)
        out[..., a:z, :] = torch.matmul(p if keep is None else p * keep, vf)
        lse[..., a:z] = m
    return out.view(b, h, sq, dv), lse.view(b, h, sq), None


def block_backward(dout, q, k, v, out, lse, delta, scale, mask=None, aux=None, dropout=None):
    """Gradients of block_forward's inputs given the whole row's output
    gradient dout [B, H, Sq, Dv], output `out` (in q's dtype), log-sum-exp
    lse [B, H, Sq] and delta = rowsum(dout * out) [B, H, Sq] (the merged
    ones: the block's share of the whole attention); `aux` is what
    block_forward returned third, `dropout` what it was given. Returns float32 dq [B, H, Sq, D],
    dk [B, Hk, Skv, D], dv [B, Hk, Skv, Dv]."""
    b, h, sq, d = q.shape
    hk, skv, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hk
    if aux is not None:
        qc, kc, vc = q.contiguous(), _expand(k, g).contiguous(), _expand(v, g).contiguous()
        do, oc, lc = dout.contiguous(), out.contiguous(), lse.contiguous()
        causal = mask is not None
        if q.is_cuda:
            cum_q, cum_k, max_q, max_k, seed, offset = aux
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do, qc, kc, vc, oc, lc, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
        else:
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, qc, kc, vc, oc, lc, 0.0, causal, scale=scale)
        return (gq.float(), gk.float().view(b, hk, g, skv, d).sum(2),
                gv.float().view(b, hk, g, skv, dv_).sum(2))
    qf = q.reshape(b, hk, g, sq, d).float()
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    do = dout.reshape(b, hk, g, sq, dv_).float()
    lse = lse.reshape(b, hk, g, sq)
    delta = delta.reshape(b, hk, g, sq)
    dq = torch.empty_like(qf)
    dk = q.new_zeros((b, hk, skv, d), dtype=torch.float32)
    dv = q.new_zeros((b, hk, skv, dv_), dtype=torch.float32)
    for a, z in _tiles(sq, b * h * skv):
        s = _scores(qf[..., a:z, :], kf, scale, _mask_rows(mask, a, z, skv, q.device))
        m = lse[..., a:z]
        p = s.sub_(torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1)).exp_()
        dot = do[..., a:z, :]
        keep = _keep(p.shape, dropout, a, q.device)
        dv += torch.matmul((p if keep is None else p * keep).transpose(-1, -2), dot).sum(2)
        dp = torch.matmul(dot, vf.transpose(-1, -2))
        if keep is not None:
            dp.mul_(keep)
        ds = dp.sub_(delta[..., a:z].unsqueeze(-1)).mul_(p)
        dq[..., a:z, :] = torch.matmul(ds, kf).mul_(scale)
        dk += torch.matmul(ds.transpose(-1, -2), qf[..., a:z, :]).sum(2).mul_(scale)
    return dq.view(b, h, sq, d), dk, dv


def _merge(out, lse, o, m):
    """Merge a partial result (o, m) into (out, lse) by log-sum-exp."""
    new = torch.logaddexp(lse, m)
    base = torch.where(torch.isinf(new), 0.0, new)
    return (out * torch.exp(lse - base).unsqueeze(-1) + o * torch.exp(m - base).unsqueeze(-1)), new
