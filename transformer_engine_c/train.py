"""The main job's model, data and training loop (`python -m transformer_engine_c`
runs them; examples/train.py is the same model as one short script).

A small GPT-style decoder built of the package's layers, tensor parallel with
sequence parallelism over every rank: token + position embeddings, N blocks of
[LayerNormLinear qkv (column) -> causal scaled_dot_product_attention on this
rank's heads -> Linear proj (row)] and [LayerNormMLP (norm, fc1 column, GELU,
fc2 row)], each block under tec.checkpoint, then LayerNormLinear (final
norm + vocabulary head, not tensor parallel). Activations between blocks are
[seq / tp, batch, hidden]. Trained with AdamW on a generated language (see
MarkovCopyData) under tec.debug.check_saved_tensors, with or without
userbuffers overlap; `run()` returns the losses, the held-out loss, tokens/s
and what each communicator counted.
"""
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import transformer_engine_c as tec
from .distributed import all_reduce_coalesced
from .distributed_weight import DistributedWeight


# ------------------------------------------------------------------- data

class MarkovCopyData:
    """Sequences of a generated language that needs no download: the first
    `period` tokens follow a sparse random Markov chain over `vocab` tokens
    (each token has `branch` possible successors), and the rest of the
    sequence repeats them. A model learns the chain's transitions from the
    previous token (the loss falls from ln(vocab) towards the chain's entropy)
    and, with attention looking `period` tokens back, the copies (the loss
    falls towards `optimal_loss`, where only the first period is uncertain).

    The training and held-out sets are drawn from the same chain with
    different seeds. Every rank builds the same data (same seed)."""

    def __init__(self, vocab, seq, period, n_train, n_heldout, seed=0, branch=3):
        if not 1 <= period <= seq:
            raise ValueError(f"period must be in [1, seq={seq}], got {period}")
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq, self.period = vocab, seq, period
        trans = torch.zeros(vocab, vocab, dtype=torch.float64)
        for a in range(vocab):
            succ = torch.randperm(vocab, generator=g)[:branch]
            trans[a, succ] = torch.softmax(torch.randn(branch, generator=g, dtype=torch.float64), 0)
        self.trans = trans
        self.train = self._sample(n_train, g)
        self.heldout = self._sample(n_heldout, torch.Generator().manual_seed(seed + 1))

    def _sample(self, n, g):
        head = torch.empty(n, self.period, dtype=torch.long)
        head[:, 0] = torch.randint(self.vocab, (n,), generator=g)
        for t in range(1, self.period):
            head[:, t] = torch.multinomial(self.trans[head[:, t - 1]], 1, generator=g)[:, 0]
        reps = -(-(self.seq + 1) // self.period)
        return head.repeat(1, reps)[:, :self.seq + 1].contiguous()  # [n, seq + 1]: inputs and next tokens

    def optimal_loss(self, seqs):
        """Mean loss per predicted token of the generator itself on `seqs`: only
        the chain's steps inside the first period are uncertain."""
        p = self.trans[seqs[:, :self.period - 1], seqs[:, 1:self.period]]
        return float(-p.log().sum(1).mean() / self.seq)

    def batches(self, batch, seed):
        """Endless training batches [batch, seq + 1], reshuffled every epoch."""
        g = torch.Generator().manual_seed(seed)
        while True:
            perm = torch.randperm(len(self.train), generator=g)
            for i in range(0, len(perm) - batch + 1, batch):
                yield self.train[perm[i:i + batch]]


# ------------------------------------------------------------------ model

class Attention(torch.nn.Module):
    """qkv (column) -> causal attention over this rank's heads -> proj (row)."""

    def __init__(self, hidden, heads, tp_group, tp_size, overlap, **kw):
        super().__init__()
        self.heads_local, self.head_dim = heads // tp_size, hidden // heads
        # Column layer: gathers the sequence (overlapped with the GEMM), computes
        # this rank's heads. Backward: the input all-gather for wgrad during
        # dgrad, the dgrad reduce-scatter during wgrad (TE's bulk overlaps).
        self.qkv = tec.LayerNormLinear(hidden, 3 * hidden, parallel_mode="column", sequence_parallel=True,
                                       tp_group=tp_group, **kw,
                                       **(dict(ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True,
                                               ub_name="qkv") if overlap else {}))
        # Row layer: GEMM overlapped with the reduce-scatter back to [seq/tp, ...].
        self.proj = tec.Linear(hidden, hidden, parallel_mode="row", sequence_parallel=True, tp_group=tp_group,
                               **kw, **(dict(ub_overlap_rs=True, ub_overlap_ag=True, ub_name="proj")
                                        if overlap else {}))

    def forward(self, x):
        qkv = self.qkv(x)                                       # [seq, batch, 3 * hidden / tp]
        s, b = qkv.shape[:2]
        # This rank's output columns are its heads, each [q | k | v].
        q, k, v = qkv.view(s, b, self.heads_local, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # [batch, heads/tp, seq, head_dim]
        o = o.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        return self.proj(o)                                     # [seq / tp, batch, hidden]


def mlp(hidden, ffn, tp_group, tp_size, overlap, **kw):
    """The MLP as one tec.LayerNormMLP: norm -> fc1 (column) -> gelu (tanh) ->
    fc2 (row), with fc1's all-gather and dgrad reduce-scatter and fc2's
    reduce-scatter and grad_output all-gather overlapped (the fc1_* / fc2_*
    communicators)."""
    return tec.LayerNormMLP(hidden, ffn, sequence_parallel=True, tp_group=tp_group, tp_size=tp_size,
                            set_parallel_mode=True, activation="gelu", **kw,
                            **(dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True)
                               if overlap else {}))


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, ffn, tp_group, tp_size, overlap, **kw):
        super().__init__()
        self.attn = Attention(hidden, heads, tp_group, tp_size, overlap, **kw)
        self.mlp = mlp(hidden, ffn, tp_group, tp_size, overlap, **kw)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class GPT(torch.nn.Module):
    """Embeddings (replicated), tensor-parallel blocks, final norm + head
    (replicated; with distributed_weight its weight is a DistributedWeight
    sharded over the tensor-parallel group, FSDP-style)."""

    def __init__(self, vocab, seq, hidden, heads, ffn, layers, tp_group, overlap, checkpoint, dtype, device,
                 distributed_weight=False):
        super().__init__()
        self.tp_group, self.checkpoint = tp_group, checkpoint
        self.tp_size, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        kw = dict(params_dtype=dtype, device=device)
        # Replicated parameters: the same values on every rank (same seed).
        self.tok = torch.nn.Embedding(vocab, hidden, dtype=dtype, device=device)
        self.pos = torch.nn.Embedding(seq, hidden, dtype=dtype, device=device)
        with torch.no_grad():
            self.tok.weight.mul_(0.02)
            self.pos.weight.mul_(0.02)
        self.head = tec.LayerNormLinear(hidden, vocab, **kw)
        if distributed_weight:
            self.head.weight = DistributedWeight.from_full(self.head.weight, group=tp_group)
        self.replicated = list(self.parameters())
        self.blocks = torch.nn.ModuleList(Block(hidden, heads, ffn, tp_group, self.tp_size, overlap, **kw)
                                          for _ in range(layers))
        # Tensor-parallel weights: each rank takes its slice of a full weight
        # drawn from one seed, so the model is the same whatever the number of
        # ranks (a run on 1 rank and on 2 follow the same curve).
        g = torch.Generator().manual_seed(torch.initial_seed() + 1)
        with torch.no_grad():
            for blk in self.blocks:
                residual = (2 * layers) ** -0.5
                for weight, split_dim, scale in ((blk.attn.qkv.weight, 0, 1.0), (blk.attn.proj.weight, 1, residual),
                                                 (blk.mlp.fc1_weight, 0, 1.0), (blk.mlp.fc2_weight, 1, residual)):
                    # uniform(+-1/sqrt(fan_in)) as nn.Linear; residual branches
                    # scaled down by sqrt(2 * layers) as in GPT-2
                    shape = list(weight.shape)   # this rank's slice
                    shape[split_dim] *= self.tp_size
                    bound = scale / math.sqrt(shape[1])
                    full = (torch.rand(*shape, generator=g) * 2 - 1) * bound
                    weight.copy_(full.chunk(self.tp_size, split_dim)[self.tp_rank])

    def forward(self, tokens):
        """tokens [seq, batch] (every rank the whole sequence) -> logits of this
        rank's tokens [seq / tp, batch, vocab]."""
        s = tokens.shape[0] // self.tp_size
        lo = self.tp_rank * s
        pos = torch.arange(lo, lo + s, device=tokens.device)
        x = self.tok(tokens[lo:lo + s]) + self.pos(pos)[:, None]    # [seq / tp, batch, hidden]
        for blk in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = tec.checkpoint(blk, x)
            else:
                x = blk(x)
        return self.head(x)


def sync_grads(model):
    """Sum over the tensor-parallel group the gradients that each rank has only
    a part of after backward:
      * replicated parameters outside the tensor-parallel layers (embeddings,
        final norm, head): under sequence parallelism each rank saw only its
        own tokens;
      * parameters the layers mark `sequence_parallel = True` (TE/Megatron:
        norm weights and row-parallel biases whose gradients the layer leaves
        partial). Layers that sum these in backward set no mark, so nothing is
        summed twice.
    A DistributedWeight's gradient is already reduce-scattered into its shard
    by the layer. The loss of each rank is its tokens' share of the global
    mean, so sums (not means) give the global gradient."""
    seen, grads = set(), []
    params = list(model.replicated) + [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    for p in params:
        if id(p) in seen or getattr(p, "is_distributed_weight", False) or p.grad is None:
            continue
        seen.add(id(p))
        grads.append(p.grad)
    if not grads or model.tp_size == 1:
        return
    all_reduce_coalesced(grads, model.tp_group, torch.float32)   # one collective, summed in fp32


# ---------------------------------------------------------------- training

class MixedPrecisionAdamW:
    """AdamW on fp32 master copies of low-precision parameters (fp32
    parameters are stepped directly)."""

    def __init__(self, params, lr, **kw):
        self.params = list(params)
        self.master = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_()
                       for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, **kw)

    def step(self, lr):
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def lr_at(step, steps, peak):
    """Linear warm-up over the first 5% of steps, then cosine to 10% of peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def token_loss(model, seqs, device, fwd=None):
    """(this rank's summed loss / all tokens, which is this rank's share of the
    global mean) for seqs [batch, seq + 1]; fwd: the model's forward to call
    (the compiled model), the model itself by default."""
    tokens = seqs[:, :-1].t().contiguous().to(device)          # [seq, batch]
    targets = seqs[:, 1:].t().contiguous().to(device)
    s = tokens.shape[0] // model.tp_size
    lo = model.tp_rank * s
    logits = (model if fwd is None else fwd)(tokens)            # [seq / tp, batch, vocab]
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets[lo:lo + s].reshape(-1),
                         reduction="sum")
    return ce / targets.numel()


@torch.no_grad()
def heldout_loss(model, data, batch, device):
    total, n = torch.zeros((), device=device), 0
    for i in range(0, len(data.heldout) - batch + 1, batch):
        total += token_loss(model, data.heldout[i:i + batch], device)
        n += 1
    dist.all_reduce(total, group=model.tp_group)
    return total.item() / n


class Progress:
    """A plain-text progress bar on rank 0: redrawn in place on a terminal,
    one line per tenth of the run otherwise (logs, pytest)."""

    def __init__(self, label, total, enabled, tty):
        self.label, self.total, self.enabled, self.tty = label, total, enabled, tty
        self.every = max(1, total // 10)

    def update(self, step, loss, tok_s):
        if not self.enabled:
            return
        done = step + 1
        if not self.tty and done % self.every and done != self.total:
            return
        width = 30
        fill = width * done // self.total
        line = (f"{self.label} [{'#' * fill}{'.' * (width - fill)}] {done:>{len(str(self.total))}}/{self.total}"
                f"  loss {loss:.4f}  {tok_s:,.0f} tok/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty and done != self.total else "\n",
              flush=True)


def run(cfg, data, overlap, device, dtype, tp_group, progress):
    """Train the model once from cfg["seed"]; return this run's record (the
    same on every rank)."""
    size = dist.get_world_size(tp_group)
    torch.manual_seed(cfg["seed"])
    if overlap:
        # One communicator per TE layer name, buffers of the gathered
        # activations [seq * batch, hidden]. min_chunk_flops=0: every
        # overlapped path runs at this small size (the job shows them working;
        # on GPUs the default thresholds would fall back at these sizes).
        tec.initialize_ub([cfg["seq"] * cfg["batch"], cfg["hidden"]], size, dtype=dtype, tp_group=tp_group,
                          device=device, min_chunk_flops=0)
    try:
        model = GPT(cfg["vocab"], cfg["seq"], cfg["hidden"], cfg["heads"], cfg["ffn"], cfg["layers"], tp_group,
                    overlap, cfg["checkpoint"], dtype, device, cfg["distributed_weight"])
        opt = MixedPrecisionAdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.01)
        fwd = model
        if cfg.get("compile"):  # the same model, traced whole (the eager model still answers attribute reads)
            fwd = torch.compile(model, fullgraph=True, mode=None if cfg["compile"] == "default" else cfg["compile"])
        batches = data.batches(cfg["batch"], cfg["seed"] + 7)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        start_heldout = heldout_loss(model, data, cfg["batch"], device)
        losses, t_train = [], 0.0
        tokens_per_step = cfg["batch"] * cfg["seq"]
        with tec.debug.check_saved_tensors(model=model) as checker:
            for step in range(cfg["steps"]):
                sync()
                t0 = time.perf_counter()
                loss = token_loss(model, next(batches), device, fwd)
                loss.backward()
                sync_grads(model)
                opt.step(lr_at(step, cfg["steps"], cfg["lr"]))
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total, group=tp_group)   # the global mean loss (also syncs the step)
                losses.append(total.item())
                dt = time.perf_counter() - t0
                if step > 0:    # the first step pays for allocation and warm-up
                    t_train += dt
                tok_s = tokens_per_step * max(1, step) / t_train if t_train else tokens_per_step / dt
                progress.update(step, losses[-1], tok_s)
        end_heldout = heldout_loss(model, data, cfg["batch"], device)
        stats = {}
        if overlap:
            for name in tec.LAYER_NAMES:
                st = tec.get_ub(name).stats()
                stats[name] = {k: int(st.get(k, 0)) for k in STAT_KEYS}
        gathers = sum(p.gather_count for p in model.parameters() if isinstance(p, DistributedWeight))
    finally:
        if overlap:
            tec.destroy_ub()
    timed = cfg["steps"] - 1
    return {"overlap": overlap, "losses": losses, "heldout_start": start_heldout, "heldout_end": end_heldout,
            "tokens_per_s": tokens_per_step * timed / t_train if timed and t_train else None,
            "train_seconds": t_train, "stats": stats, "saved_tensors_checked": checker.checked,
            "alias_violations": len(checker.violations), "distributed_weight_gathers": gathers}


STAT_KEYS = ("ag_overlap", "rs_overlap", "bulk_ag", "bulk_rs", "ag_fallback", "rs_fallback")


# ----------------------------------------------------- checks on the results

def falls(losses, factor=0.5, window=10):
    """Whether the mean of the last `window` losses is below `factor` times the
    mean of the first `window` (the loss fell well below its start)."""
    w = max(1, min(window, len(losses) // 4))
    if len(losses) < 2 * w:
        return False
    first, last = sum(losses[:w]) / w, sum(losses[-w:]) / w
    return last < factor * first


def curve_gap(a, b, window=1):
    """Largest relative difference between two loss curves, after averaging
    over consecutive windows of `window` steps (window 1: step by step)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"loss curves of different lengths ({len(a)}, {len(b)})")
    gap = 0.0
    for i in range(0, len(a), window):
        x, y = a[i:i + window], b[i:i + window]
        ma, mb = sum(x) / len(x), sum(y) / len(y)
        gap = max(gap, abs(ma - mb) / max(abs(mb), 1e-12))
    return gap


def agreement_tolerance(dtype):
    """(window, relative tolerance) for overlap on/off loss curves. fp32: step
    by step; the two runs differ only in the order of a few sums. bf16/fp16:
    10-step means, since rounding differences grow along a training run."""
    return (1, 1e-3) if dtype == torch.float32 else (10, 5e-2)
