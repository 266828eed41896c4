"""Context parallelism for DotProductAttention: each sequence split over a
group of ranks the way TransformerEngine and Megatron-Core split it (2 x cp
chunks, rank r holding chunks r and 2cp-1-r), attention computed against the
other ranks' keys and values. Exercised by tests/distributed/run_cp.py
(launched from tests/distributed/test_cp.py), run_megatron_cp.py
(Megatron-Core's GPT), tests/test_cp_kernel.py; timed by
`python -m transformer_engine_c.bench --cp`.

cp_comm_type:
  * "p2p": a ring of cp steps; each step attends the local queries to the
    key/value shard in hand while the next shard travels (send to the next
    rank, receive from the previous one; on CUDA issued on `cp_stream`).
    Partial results merge exactly by their log-sum-exp. Under the causal
    mask a step attends only the rows and columns that can see each other
    (the balanced layout makes every rank's work equal). The backward runs
    the ring again; the key/value gradient sums travel with the shards and
    take one more hop home.
  * "all_gather": the keys and values of the whole group gathered first,
    their gradients reduce-scattered back.
  * "a2a": an all-to-all gives each rank all of the sequence for
    heads / cp of the heads (DeepSpeed-Ulysses); attention is local; a
    second all-to-all returns the output to the sequence shards.
  * "a2a+p2p": the all-to-all inside cp_group[0], the ring across
    cp_group[1]; the group's rank is p2p_rank * a2a_size + a2a_rank.

Masks are computed from each token's position in its whole sequence (and,
for thd, its sequence and whether it is padding), so causal masks, sliding
windows and thd padding mean what they mean without context parallelism.
Attention dropout draws each block's mask from a seeded generator and
redraws it in backward. Every wait on a peer has a timeout
(TEC_COMM_TIMEOUT, 60 s) and raises ContextParallelTimeout naming the peer
and the step.

The attention of a block is `block_forward` / `block_backward`: PyTorch's
flash kernel (CPU; CUDA in bf16/fp16) where a block has no mask or the
square causal one and equal query and value head sizes, else float32
arithmetic over row tiles. Each returns the block's log-sum-exp; the
backward recomputes probabilities from the merged log-sum-exp (the
flash-attention recurrence)."""
import datetime
import math
import time

import torch
import torch.distributed as dist

from .._comm_config import default_timeout
from ..distributed import _all_gather_flat, _reduce_scatter_flat
from .cp_blocks import CAUSAL, PositionMask, _merge, _stats, block_backward, block_forward, reset_stats, stats

__all__ = ["COMM_TYPES", "ContextParallelTimeout", "CPConfig", "PositionMask", "cp_config", "attention",
           "shard_sequence", "shard_thd", "stats", "reset_stats", "block_forward", "block_backward"]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
CP_MASK_TYPES = ("no_mask", "causal")

class ContextParallelTimeout(RuntimeError):
    """A context-parallel exchange did not complete within the timeout."""


class CPConfig:
    """A DotProductAttention's context-parallel group, checked once by
    cp_config: the comm type, the whole group's size and this rank's place
    in it, and the a2a and p2p sub-groups (one of them trivial except for
    a2a+p2p)."""
    __slots__ = ("comm_type", "size", "rank", "a2a_group", "a2a_size", "a2a_rank", "group", "p2p_size",
                 "p2p_rank", "p2p_ranks", "stream", "timeout")


def _size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def cp_config(cp_group, cp_global_ranks, cp_stream, cp_comm_type, owner="DotProductAttention"):
    """The checked CPConfig of TE's (cp_group, cp_global_ranks, cp_stream,
    cp_comm_type), or None where there is no context parallelism (no group,
    or a group of one rank)."""
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"{owner}: cp_comm_type must be one of {COMM_TYPES}, got {cp_comm_type!r}")
    if cp_group is None:
        return None
    pair = isinstance(cp_group, (list, tuple))
    if cp_comm_type == "a2a+p2p":
        if not pair or len(cp_group) != 2:
            raise ValueError(f"{owner}: cp_group must be a pair [a2a group, p2p group] with cp_comm_type="
                             f"'a2a+p2p', got {cp_group!r}")
        a2a_group, group = cp_group
    elif pair:
        raise ValueError(f"{owner}: cp_group is a list of groups, which only cp_comm_type='a2a+p2p' takes; "
                         f"cp_comm_type={cp_comm_type!r} takes one process group")
    else:
        a2a_group, group = (cp_group, None) if cp_comm_type == "a2a" else (None, cp_group)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{owner}: cp_group was given but torch.distributed is not initialized")
    a2a_size, a2a_rank = _size_rank(a2a_group) if a2a_group is not None else (1, 0)
    p2p_size, p2p_rank = _size_rank(group) if group is not None else (1, 0)
    if min(a2a_size, a2a_rank, p2p_size, p2p_rank) < 0:
        raise ValueError(f"{owner}: rank {dist.get_rank()} is not a member of cp_group")
    size = a2a_size * p2p_size
    if size == 1:
        return None
    rank = p2p_rank * a2a_size + a2a_rank
    if cp_global_ranks is None:
        if pair:
            raise ValueError(f"{owner}: cp_global_ranks is required with cp_comm_type='a2a+p2p' (the whole "
                             "context-parallel group's global ranks)")
        cp_global_ranks = dist.get_process_group_ranks(cp_group)
    ranks = [int(r) for r in cp_global_ranks]
    me = dist.get_rank()
    if len(ranks) != size or len(set(ranks)) != size or ranks[rank] != me:
        raise ValueError(f"{owner}: cp_global_ranks {ranks} does not match cp_group ({size} ranks, this rank "
                         f"{me} at place {rank} of the group)")
    if a2a_group is not None:
        want = [ranks[p2p_rank * a2a_size + a] for a in range(a2a_size)]
        if dist.get_process_group_ranks(a2a_group) != want:
            raise ValueError(f"{owner}: cp_global_ranks {ranks} does not match the a2a group "
                             f"{dist.get_process_group_ranks(a2a_group)} (expected {want})")
    p2p_ranks = [ranks[p * a2a_size + a2a_rank] for p in range(p2p_size)]
    if group is not None and dist.get_process_group_ranks(group) != p2p_ranks:
        raise ValueError(f"{owner}: cp_global_ranks {ranks} does not match cp_group's ranks "
                         f"{dist.get_process_group_ranks(group)} (expected {p2p_ranks})")
    if cp_stream is not None and not (torch.cuda.is_available() and isinstance(cp_stream, torch.cuda.Stream)):
        cp_stream = None  # a CPU run: the exchange is asynchronous on the process group's own threads
    cfg = CPConfig()
    cfg.comm_type, cfg.size, cfg.rank = cp_comm_type, size, rank
    cfg.a2a_group, cfg.a2a_size, cfg.a2a_rank = a2a_group, a2a_size, a2a_rank
    cfg.group, cfg.p2p_size, cfg.p2p_rank, cfg.p2p_ranks = group, p2p_size, p2p_rank, p2p_ranks
    cfg.stream, cfg.timeout = cp_stream, default_timeout()
    return cfg


# ---------------------------------------------------------------------------
# Sharding: where a rank's tokens sit in the whole sequence

def shard_sequence(x, dim, cp_size, cp_rank):
    """This rank's share of a whole sequence along `dim`: chunks cp_rank and
    2 * cp_size - 1 - cp_rank of 2 * cp_size (Megatron-Core's
    get_batch_on_this_cp_rank)."""
    n = x.shape[dim]
    if n % (2 * cp_size):
        raise ValueError(f"shard_sequence: a sequence of {n} tokens does not split into 2 x {cp_size} chunks")
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=dim)


def shard_thd(x, cu_seqlens, cp_size, cp_rank):
    """This rank's share of packed sequences x [t, ...] delimited by
    cu_seqlens: each sequence cut as shard_sequence cuts one (TE's
    thd_get_partitioned_indices)."""
    return x.index_select(0, _thd_indices(cu_seqlens, cp_size, cp_rank, x.device))


def _thd_indices(cu_seqlens, cp_size, cp_rank, device):
    cu = [int(v) for v in cu_seqlens.tolist()]
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * cp_size)
        parts += [torch.arange(a + cp_rank * c, a + (cp_rank + 1) * c),
                  torch.arange(b - (cp_rank + 1) * c, b - cp_rank * c)]
    return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long, device=device)


class _Layout:
    """Where the tokens of one rank's shard sit: `pos` [S] each token's
    position in its whole sequence, `sid` [S] its sequence (None: one
    sequence per batch row), `valid` [S] whether it is a token rather than
    padding after its sequence (None: all are), and the two halves of the
    shard (`first`, `second`: slices, or index tensors for packed
    sequences)."""
    __slots__ = ("pos", "sid", "valid", "first", "second")


def _layout(ring_size, ring_rank, local_len, lens, device, actual=None):
    """The layout of ring rank `ring_rank`'s shard: `local_len` tokens of one
    sequence per batch row (lens None), or packed sequences of whole
    (padded) lengths `lens`, of which the first `actual[i]` tokens are the
    sequence's (actual None: all)."""
    out = _Layout()
    out.valid = None
    if lens is None:
        c = local_len // 2
        ar = torch.arange(c, device=device)
        out.pos = torch.cat((ring_rank * c + ar, (2 * ring_size - 1 - ring_rank) * c + ar))
        out.sid, out.first, out.second = None, slice(0, c), slice(c, 2 * c)
        return out
    pos, sid, first, second = [], [], [], []
    offset = 0
    for i, n in enumerate(lens):
        c = n // (2 * ring_size)
        ar = torch.arange(c)
        pos += [ring_rank * c + ar, (2 * ring_size - 1 - ring_rank) * c + ar]
        sid.append(torch.full((2 * c,), i, dtype=torch.long))
        first.append(offset + ar)
        second.append(offset + c + ar)
        offset += 2 * c
    empty = torch.zeros(0, dtype=torch.long)
    out.pos = (torch.cat(pos) if pos else empty).to(device)
    out.sid = (torch.cat(sid) if sid else empty).to(device)
    out.first = (torch.cat(first) if first else empty).to(device)
    out.second = (torch.cat(second) if second else empty).to(device)
    if actual is not None:
        out.valid = out.pos < torch.tensor(actual, dtype=torch.long, device=device)[out.sid]
    return out


# ---------------------------------------------------------------------------
# Exchanges with peers

overlap_exchanges = True  # False: the ring waits for each message as soon as it is sent (the benchmark's baseline)


def _wait(work, cfg, is_cuda, describe):
    """Wait for `work` at most cfg.timeout seconds; on timeout raise
    ContextParallelTimeout with describe() (who and which step). On CUDA the
    host polls the work's completion (an NCCL wait alone only orders
    streams, and would not notice a silent peer)."""
    if is_cuda:
        deadline = time.monotonic() + cfg.timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise ContextParallelTimeout(f"{describe()} did not complete within {cfg.timeout:g} s "
                                             "(TEC_COMM_TIMEOUT)")
            time.sleep(2e-5)
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=cfg.timeout))
    except RuntimeError as e:
        raise ContextParallelTimeout(f"{describe()} did not complete within {cfg.timeout:g} s "
                                     f"(TEC_COMM_TIMEOUT): {e}") from e


class _Exchange:
    """One message each way around the ring in flight: `send` to the next
    rank, `recv` from the previous one (tagged by what they carry)."""

    def __init__(self, cfg, send, recv, what, step, tag):
        self.cfg, self.recv, self.what, self.step, self.done = cfg, recv, what, step, False
        n = cfg.p2p_size
        self.nxt = cfg.p2p_ranks[(cfg.p2p_rank + 1) % n]
        self.prv = cfg.p2p_ranks[(cfg.p2p_rank - 1) % n]
        ops = [dist.P2POp(dist.isend, send, self.nxt, cfg.group, tag),
               dist.P2POp(dist.irecv, recv, self.prv, cfg.group, tag)]
        stream = cfg.stream if send.is_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.works = dist.batch_isend_irecv(ops)
        else:
            self.works = dist.batch_isend_irecv(ops)
        self.stream = stream

    def wait(self):
        if self.done:
            return self.recv
        works = self.works if len(self.works) == 2 else self.works * 2  # NCCL may coalesce the pair into one
        for work, peer, way in ((works[1], self.prv, "receive from"), (works[0], self.nxt, "send to")):
            _wait(work, self.cfg, self.recv.is_cuda,
                  lambda: f"context parallelism ({self.cfg.comm_type}): {self.what} step {self.step}: {way} rank "
                          f"{peer}")
        if self.stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self.stream)
            self.recv.record_stream(current)
        self.done = True
        return self.recv


def _checked(work, cfg, what, ranks, is_cuda):
    """Wait for a collective of the context-parallel group, with the timeout."""
    _wait(work, cfg, is_cuda, lambda: f"context parallelism ({cfg.comm_type}): {what} on ranks {ranks}")


def _pack(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat, shapes):
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[at:at + n].view(shape))
        at += n
    return out


# ---------------------------------------------------------------------------
# p2p: the ring (also the local attention of a2a, a ring of one)

class _Plan:
    """What one context-parallel attention call needs beyond its tensors."""
    __slots__ = ("cfg", "causal", "window", "scale", "lens", "layouts", "dropout_p", "seed")

    def dropout(self, block):
        """block_forward's `dropout` for block number `block` of this rank's
        call (a seed of its own per rank and block), or None."""
        if not self.dropout_p:
            return None
        return self.dropout_p, ((self.seed * 31 + self.cfg.rank) * 1000003 + block) % (1 << 62)


def _step_blocks(plan, step):
    """(query rows, key/value columns, allowed mask) of ring step `step`:
    this rank's queries against the shard of rank (rank - step) mod n."""
    cfg = plan.cfg
    n, r = cfg.p2p_size, cfg.p2p_rank
    j = (r - step) % n
    mine, theirs = plan.layouts[r], plan.layouts[j]
    rows, cols = slice(None), slice(None)
    if plan.causal and j < r:
        cols = theirs.first  # their second half lies after all of this rank's queries
    elif plan.causal and j > r:
        rows = mine.second  # this rank's first half lies before all of their keys
    qp, kp = mine.pos[rows], theirs.pos[cols]
    qs = None if mine.sid is None else mine.sid[rows]
    ks = None if theirs.sid is None else theirs.sid[cols]
    if mine.sid is None and plan.window == ((-1, 0) if plan.causal else (-1, -1)):
        # one sequence per row, no window: the diagonal block is plain causal (the shard's positions
        # increase), every other block sees all of its columns
        return rows, cols, (CAUSAL if plan.causal and step == 0 else None)
    qv = None if mine.valid is None else mine.valid[rows]
    kv = None if theirs.valid is None else theirs.valid[cols]
    return rows, cols, PositionMask(qp, qs, kp, ks, plan.causal, plan.window, qv, kv)


def _cols(t, cols):
    return t if isinstance(cols, slice) and cols == slice(None) else t[:, :, cols]


def _overlap(ex):
    """Let `ex` travel during the step's attention (or, without
    overlap_exchanges, finish it first)."""
    if overlap_exchanges:
        _stats["p2p_overlapped"] += 1
    else:
        ex.wait()


def _ring(cfg, k, v, what, tag):
    """Yield (step, k, v) for each step of the ring: this rank's key/value
    shard first, then each shard the ring passes on. The next shard's
    exchange starts before a step's attention and is waited for after it."""
    n = cfg.p2p_size
    shapes = (k.shape, v.shape)
    kv = _pack(k, v) if n > 1 else None
    for step in range(n):
        ex = None
        if step + 1 < n:
            ex = _Exchange(cfg, kv, torch.empty_like(kv), what, step, tag=tag)
            _overlap(ex)
        yield step, k, v
        if ex is not None:
            kv = ex.wait()
            k, v = _unpack(kv, shapes)


class _RingAttention(torch.autograd.Function):
    """q [B, H, S, D], k/v [B, Hk, S, D(v)] this rank's shard of the ring's
    layout; returns the output [B, H, S, Dv] in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        cfg = plan.cfg
        out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        auxes = []
        for step, cur_k, cur_v in _ring(cfg, k, v, "forward key/value", tag=0):
            rows, cols, mask = _step_blocks(plan, step)
            o, m, aux = block_forward(q[:, :, rows], _cols(cur_k, cols), _cols(cur_v, cols), plan.scale, mask,
                                      plan.dropout(step))
            auxes.append(aux)
            out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], o, m)
            _stats["p2p_steps"] += 1
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plan, ctx.auxes = plan, auxes
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        cfg = plan.cfg
        n = cfg.p2p_size
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        shapes = (k.shape, v.shape)
        dkv = None
        for step, cur_k, cur_v in _ring(cfg, k, v, "backward key/value", tag=1):
            rows, cols, mask = _step_blocks(plan, step)
            gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], _cols(cur_k, cols), _cols(cur_v, cols),
                                        out[:, :, rows], lse[:, :, rows], delta[:, :, rows], plan.scale, mask,
                                        ctx.auxes[step], plan.dropout(step))
            dq[:, :, rows] += gq
            dk_step = torch.zeros(cur_k.shape, dtype=torch.float32, device=q.device)
            dv_step = torch.zeros(cur_v.shape, dtype=torch.float32, device=q.device)
            dk_step[:, :, cols] = gk
            dv_step[:, :, cols] = gv
            if dkv is not None:  # the sums for this shard so far, from the ranks it passed
                acc = dkv.wait()
                dk_prev, dv_prev = _unpack(acc, shapes)
                dk_step += dk_prev
                dv_step += dv_prev
            _stats["p2p_steps"] += 1
            if n > 1:  # pass the sums on with the shard; after the last step they reach its owner
                flat = _pack(dk_step, dv_step)
                dkv = _Exchange(cfg, flat, torch.empty_like(flat), "backward key/value gradient", step, tag=2)
                if not overlap_exchanges:
                    dkv.wait()
            else:
                dk_tot, dv_tot = dk_step, dv_step
        if n > 1:
            dk_tot, dv_tot = _unpack(dkv.wait(), shapes)
        return dq.to(q.dtype), dk_tot.to(k.dtype), dv_tot.to(v.dtype), None


# ---------------------------------------------------------------------------
# all_gather

class _GatheredAttention(torch.autograd.Function):
    """The whole group's keys and values gathered, attention of this rank's
    queries over them (block by block, _gathered_blocks); their gradients
    reduce-scattered back."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        cfg = plan.cfg
        k_all = torch.cat(_gather(k.contiguous(), cfg), dim=2)
        v_all = torch.cat(_gather(v.contiguous(), cfg), dim=2)
        out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        auxes = []
        for i, (rows, cols, mask) in enumerate(_gathered_blocks(plan, q.device)):
            o, m, aux = block_forward(q[:, :, rows], _cols(k_all, cols), _cols(v_all, cols), plan.scale, mask,
                                      plan.dropout(i))
            out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], o, m)
            auxes.append(aux)
        result = out.to(q.dtype)
        _stats["all_gather"] += 1
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plan, ctx.auxes = plan, auxes
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        cfg = plan.cfg
        k_all = torch.cat(_gather(k.contiguous(), cfg), dim=2)
        v_all = torch.cat(_gather(v.contiguous(), cfg), dim=2)
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk_all = torch.zeros_like(k_all, dtype=torch.float32)
        dv_all = torch.zeros_like(v_all, dtype=torch.float32)
        for i, ((rows, cols, mask), aux) in enumerate(zip(_gathered_blocks(plan, q.device), ctx.auxes)):
            gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], _cols(k_all, cols), _cols(v_all, cols),
                                        out[:, :, rows], lse[:, :, rows], delta[:, :, rows], plan.scale, mask, aux,
                                        plan.dropout(i))
            dq[:, :, rows] += gq
            if isinstance(cols, slice):
                dk_all[:, :, cols] += gk
                dv_all[:, :, cols] += gv
            else:
                dk_all.index_add_(2, cols, gk)
                dv_all.index_add_(2, cols, gv)
        dk, dv = _reduce_scatter(dk_all, cfg), _reduce_scatter(dv_all, cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _gathered_blocks(plan, device):
    """(query rows, gathered key/value columns, mask) of the all_gather
    attention. One sequence per row without a window: the causal attention of
    each of this rank's chunks is a block over every earlier chunk (no mask)
    and the square causal block of its own chunk; without the causal mask one
    block. Otherwise one block masked by position."""
    cfg = plan.cfg
    mine = plan.layouts[cfg.p2p_rank]
    if mine.sid is not None or plan.window != ((-1, 0) if plan.causal else (-1, -1)):
        k_pos = torch.cat([plan.layouts[j].pos for j in range(cfg.p2p_size)])
        k_sid = None if mine.sid is None else torch.cat([plan.layouts[j].sid for j in range(cfg.p2p_size)])
        k_valid = None if mine.valid is None else torch.cat([plan.layouts[j].valid for j in range(cfg.p2p_size)])
        return [(slice(None), slice(None), PositionMask(mine.pos, mine.sid, k_pos, k_sid, plan.causal, plan.window,
                                                        mine.valid, k_valid))]
    if not plan.causal:
        return [(slice(None), slice(None), None)]
    n, r = cfg.p2p_size, cfg.p2p_rank
    c = mine.first.stop  # tokens of a chunk; a rank's shard is 2c, gathered in rank order

    def columns(chunk):  # where the whole sequence's chunk sits in the gathered keys
        start = chunk * 2 * c if chunk < n else (2 * n - 1 - chunk) * 2 * c + c
        return torch.arange(start, start + c, device=device)

    blocks = []
    for rows, chunk in ((mine.first, r), (mine.second, 2 * n - 1 - r)):
        if chunk:
            blocks.append((rows, torch.cat([columns(i) for i in range(chunk)]), None))
        blocks.append((rows, columns(chunk), CAUSAL))
    return blocks


def _gather(t, cfg):
    """[B, H, S, D] of every rank of the group, in group order."""
    out = t.new_empty((cfg.p2p_size, *t.shape))
    work = _all_gather_flat(out.view(cfg.p2p_size * t.shape[0], *t.shape[1:]), t, group=cfg.group,
                                       async_op=True)
    _checked(work, cfg, "key/value all-gather", cfg.p2p_ranks, t.is_cuda)
    return list(out.unbind(0))


def _reduce_scatter(t, cfg):
    """The sum over the group of each rank's S-long slice along dim 2."""
    n = cfg.p2p_size
    b, h, s, d = t.shape
    parts = t.view(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    out = t.new_empty((b, h, s // n, d))
    work = _reduce_scatter_flat(out.view(b, h * (s // n), d), parts.view(n * b, h * (s // n), d),
                                      group=cfg.group, async_op=True)
    _checked(work, cfg, "key/value gradient reduce-scatter", cfg.p2p_ranks, t.is_cuda)
    return out


# ---------------------------------------------------------------------------
# a2a: heads scattered, sequence gathered

def _a2a(x, cfg, what):
    n = cfg.a2a_size
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out.view(n, -1), x.view(n, -1), group=cfg.a2a_group, async_op=True)
    _checked(work, cfg, f"{what} all-to-all", dist.get_process_group_ranks(cfg.a2a_group), x.is_cuda)
    _stats["a2a"] += 1
    return out


def _heads_to_sequence(x, cfg):
    """[B, H, S, D] shards of the whole a2a group -> [B, H / n, n * S, D]: all
    of the group's sequence (in the ring's balanced layout) for this rank's
    block of heads."""
    n = cfg.a2a_size
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    got = _a2a(send, cfg, "sequence gather").view(n, b, h // n, s, d)
    first, second = got[..., :s // 2, :], got[..., s // 2:, :]
    return torch.cat([first[a] for a in range(n)] + [second[a] for a in reversed(range(n))], dim=2)


def _sequence_to_heads(x, cfg):
    """The inverse of _heads_to_sequence: [B, H / n, n * S, D] -> [B, H, S, D]."""
    n = cfg.a2a_size
    b, hn, ns, d = x.shape
    s = ns // n
    c = s // 2
    firsts = x[:, :, :n * c].view(b, hn, n, c, d)
    seconds = x[:, :, n * c:].view(b, hn, n, c, d).flip(2)
    send = torch.cat((firsts, seconds), dim=3).permute(2, 0, 1, 3, 4).contiguous()
    got = _a2a(send, cfg, "sequence scatter")
    return got.view(n, b, hn, s, d).transpose(0, 1).reshape(b, n * hn, s, d)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cfg):
        ctx.cfg = cfg
        return _heads_to_sequence(x, cfg)

    @staticmethod
    def backward(ctx, g):
        return _sequence_to_heads(g.contiguous(), ctx.cfg), None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cfg):
        ctx.cfg = cfg
        return _sequence_to_heads(x, cfg)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_sequence(g.contiguous(), ctx.cfg), None


# ---------------------------------------------------------------------------
# The entry point

def _thd_lengths(cfg, q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad):
    """(whole lengths each sequence occupies, its tokens' count or None when
    the same) of thd's cu_seqlens (and their padded forms), checked."""
    if cu_q is None or cu_kv is None:
        raise ValueError("DotProductAttention: qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv), ("cu_seqlens_q_padded", cu_q_pad),
                    ("cu_seqlens_kv_padded", cu_kv_pad)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dim() != 1
                              or t.numel() < 1 or int(t[0]) != 0 or bool((torch.diff(t) < 0).any())):
            raise ValueError(f"{name} must be an integer tensor of non-decreasing offsets [b + 1] from 0, got "
                             f"{t.tolist() if isinstance(t, torch.Tensor) else t!r}")
    if (cu_q_pad is None) != (cu_kv_pad is None):
        raise ValueError("DotProductAttention: under context parallelism give both cu_seqlens_q_padded and "
                         "cu_seqlens_kv_padded, or neither")
    for a, b, what in ((cu_q, cu_kv, "cu_seqlens"), (cu_q_pad, cu_kv_pad, "cu_seqlens_padded")):
        if a is not None and (a.shape != b.shape or not torch.equal(a.cpu(), b.cpu())):
            raise ValueError(f"DotProductAttention: under context parallelism {what}_kv must equal {what}_q "
                             f"(self-attention), got {b.tolist()} and {a.tolist()}")
    actual = torch.diff(cu_q.cpu()).tolist()
    name = "cu_seqlens_q"
    lens = actual
    if cu_q_pad is not None:
        name = "cu_seqlens_q_padded"
        lens = torch.diff(cu_q_pad.cpu()).tolist()
        if len(lens) != len(actual) or any(a > n for a, n in zip(actual, lens)):
            raise ValueError(f"cu_seqlens_q_padded ({cu_q_pad.tolist()}) must hold each sequence of cu_seqlens_q "
                             f"({cu_q.tolist()})")
    if any(n % (2 * cfg.size) for n in lens):
        raise ValueError(f"{name}: under context parallelism (cp size {cfg.size}) every sequence's length must be a "
                         f"multiple of 2 x {cfg.size}; got lengths {lens}")
    if sum(lens) // cfg.size != q.shape[0] or k.shape[0] != q.shape[0]:
        raise ValueError(f"query_layer: {name} describes {sum(lens)} tokens, so this rank's shard holds "
                         f"{sum(lens) // cfg.size} (1/{cfg.size}); got query {q.shape[0]}, key/value {k.shape[0]} "
                         "tokens")
    return lens, (None if actual == lens else actual)


def _fail(what):
    raise NotImplementedError(f"DotProductAttention under context parallelism: {what}")


def attention(q, k, v, cfg, fmt, mask_type, window, scale, cu_q, cu_kv, cu_q_pad, cu_kv_pad, bias, dropout_p):
    """DotProductAttention's forward over this rank's shards q, k, v (in
    `fmt`; thd: cu_seqlens of the whole sequences). Returns what the
    attention over the whole sequence returns for this rank's tokens (with
    dropout_p > 0, with dropout masks of its own: each block's drawn from a
    seed taken from the device's generator)."""
    kind = cfg.comm_type
    if fmt == "thd" and mask_type.startswith("padding"):  # thd is padded by cu_seqlens
        mask_type = mask_type.replace("padding_", "").replace("padding", "no_mask")
    if mask_type == "causal_bottom_right":
        mask_type = "causal"  # queries and keys have the same lengths here: the diagonals coincide
    if mask_type not in CP_MASK_TYPES:
        _fail(f"attn_mask_type={mask_type!r} is not supported with cp_comm_type={kind!r} (supported: "
              f"{CP_MASK_TYPES}, causal_bottom_right, and with thd the padding types)")
    if bias is not None:
        _fail("core_attention_bias is not supported")
    if fmt == "thd" and kind in ("a2a", "a2a+p2p"):
        _fail(f"qkv_format='thd' is not supported with cp_comm_type={kind!r} (use 'p2p' or 'all_gather')")
    lens = actual = None
    if fmt == "thd":
        lens, actual = _thd_lengths(cfg, q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    else:
        seq = 0 if fmt == "sbhd" else 1
        s = q.shape[seq]
        if s % 2 or s == 0:
            raise ValueError(f"query_layer: under context parallelism this rank's sequence ({s} tokens, {fmt}) must "
                             f"be two equal chunks (chunks {cfg.rank} and {2 * cfg.size - 1 - cfg.rank} of "
                             f"{2 * cfg.size})")
        if k.shape[seq] != s or v.shape[seq] != s:
            raise ValueError(f"key_layer/value_layer: under context parallelism keys and values must have the "
                             f"query's local sequence length {s}, got {k.shape[seq]} and {v.shape[seq]}")
        perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
        q4, k4, v4 = (t.permute(*perm) for t in (q, k, v))
    h, hk = q4.shape[1], k4.shape[1]
    if cfg.a2a_size > 1 and (h % cfg.a2a_size or hk % cfg.a2a_size):
        raise ValueError(f"num_attention_heads: with cp_comm_type={kind!r} this rank's {h} query and {hk} "
                         f"key/value heads must each divide by the a2a group's size {cfg.a2a_size}")
    plan = _Plan()
    plan.cfg, plan.causal, plan.window, plan.scale, plan.lens = cfg, mask_type == "causal", window, scale, lens
    # dropout: a seed from the device's generator (under the RNG tracker's fork, as DotProductAttention draws)
    plan.dropout_p = float(dropout_p)
    plan.seed = int(torch.randint(0, 1 << 62, (1,), device=q.device)) if dropout_p > 0 else 0
    if cfg.a2a_size > 1:
        q4, k4, v4 = (_HeadsToSequence.apply(t.contiguous(), cfg) for t in (q4, k4, v4))
    local_len = q4.shape[2]
    plan.layouts = [_layout(cfg.p2p_size, j, local_len, lens, q.device, actual) for j in range(cfg.p2p_size)]
    if kind == "all_gather":
        out = _GatheredAttention.apply(q4, k4, v4, plan)
    else:
        out = _RingAttention.apply(q4, k4, v4, plan)
    if cfg.a2a_size > 1:
        out = _SequenceToHeads.apply(out, cfg)
    if fmt == "thd":
        out = out[0].transpose(0, 1)
        return out.reshape(out.shape[0], out.shape[1] * out.shape[2])
    out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.transpose(1, 2)
    return out.reshape(out.shape[0], out.shape[1], out.shape[2] * out.shape[3])
