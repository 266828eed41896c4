"""Train a small GPT-style decoder with transformer_engine_c: tensor + sequence
parallel attention and MLP blocks, userbuffers comm-GEMM overlap, activation
checkpointing, AdamW. A script to read and copy; `python -m
transformer_engine_c` runs the same model with a report (transformer_engine_c/train.py).

    torchrun --nproc_per_node=2 examples/train.py              # CPUs (gloo)
    torchrun --nproc_per_node=4 examples/train.py --cuda       # GPUs (nccl), bf16

Every rank is in one tensor-parallel group and sees the same batch; under
sequence parallelism each rank holds seq/tp of the tokens between blocks.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import transformer_engine_c as tec

ap = argparse.ArgumentParser()
ap.add_argument("--cuda", action="store_true")
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--no-overlap", action="store_true")
args = ap.parse_args()

# ---- ranks: one tensor-parallel group of every rank
if args.cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
else:
    dist.init_process_group("gloo")
    device, dtype = torch.device("cpu"), torch.float32
tp = dist.new_group(list(range(dist.get_world_size())))
tp_size, rank = dist.get_world_size(tp), dist.get_rank(tp)
H, S, B, V, PERIOD = args.hidden, args.seq, args.batch, 32, 8
assert S % tp_size == 0 and args.heads % tp_size == 0, "seq and heads must be divisible by the ranks"
overlap = not args.no_overlap and tp_size > 1
torch.manual_seed(0)  # same seed everywhere: replicated parameters and data agree across ranks

# ---- userbuffers: one communicator per TE layer name (qkv, proj, fc1, fc2 x fprop/dgrad/wgrad),
# sized for the gathered activations [seq * batch, hidden]
if overlap:
    tec.initialize_ub([S * B, H], tp_size, dtype=dtype, tp_group=tp, device=device, min_chunk_flops=0)


def ub(**flags):
    return flags if overlap else {}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        kw = dict(sequence_parallel=True, tp_group=tp, params_dtype=dtype, device=device)
        self.qkv = tec.LayerNormLinear(H, 3 * H, parallel_mode="column", **kw,
                                       **ub(ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_name="qkv"))
        self.proj = tec.Linear(H, H, parallel_mode="row", **kw, **ub(ub_overlap_rs=True, ub_overlap_ag=True,
                                                                      ub_name="proj"))
        # norm -> fc1 (column) -> gelu -> fc2 (row) in one module, on the fc1_* / fc2_* communicators
        self.mlp = tec.LayerNormMLP(H, 4 * H, set_parallel_mode=True, **kw,
                                    **ub(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True))
        self.heads, self.hd = args.heads // tp_size, H // args.heads

    def forward(self, x):                                   # x: [seq/tp, batch, H]
        qkv = self.qkv(x)                                   # [seq, batch, 3H/tp]: this rank's heads, whole sequence
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.heads, 3, self.hd).permute(3, 1, 2, 0, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + self.proj(o)                                # reduce-scattered back to [seq/tp, batch, H]
        return x + self.mlp(x)


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(V, H, dtype=dtype, device=device)
        self.pos = torch.nn.Embedding(S, H, dtype=dtype, device=device)
        self.head = tec.LayerNormLinear(H, V, params_dtype=dtype, device=device)  # not tensor parallel
        self.replicated = list(self.parameters())   # same on every rank; grads need summing (see below)
        torch.manual_seed(100 + rank)               # each rank's shards (its heads, its FFN columns) differ
        self.blocks = torch.nn.ModuleList(Block() for _ in range(args.layers))

    def forward(self, tokens):                              # tokens: [seq, batch], all of it on every rank
        lo = rank * (S // tp_size)
        mine = slice(lo, lo + S // tp_size)
        x = self.tok(tokens[mine]) + self.pos(torch.arange(S, device=device)[mine])[:, None]
        for blk in self.blocks:
            x = tec.checkpoint(blk, x)                      # activations recomputed in backward
        return self.head(x)                                 # logits of this rank's tokens


model = GPT()
# (bf16 parameters are stepped directly here; the main job keeps fp32 master copies)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)


def batch_of_sequences():
    """A generated language: a random first-order Markov chain's first PERIOD
    tokens, then repeated (learnable from the previous token and by copying)."""
    g = torch.Generator().manual_seed(1)
    trans = torch.zeros(V, V)
    for a in range(V):
        trans[a, torch.randperm(V, generator=g)[:3]] = torch.rand(3, generator=g) + 0.1
    while True:
        head = torch.empty(B, PERIOD, dtype=torch.long)
        head[:, 0] = torch.randint(V, (B,), generator=g)
        for t in range(1, PERIOD):
            head[:, t] = torch.multinomial(trans[head[:, t - 1]], 1, generator=g)[:, 0]
        yield head.repeat(1, math.ceil((S + 1) / PERIOD))[:, :S + 1].t().to(device)  # [seq + 1, batch]


def sync_grads():
    """Sum over the group what each rank has only a part of: replicated
    parameters (each rank saw only its own tokens) and parameters a layer
    marks `sequence_parallel` (TE/Megatron convention)."""
    ps = {id(p): p for p in model.replicated + [p for p in model.parameters()
                                                 if getattr(p, "sequence_parallel", False)]}
    grads = [p.grad for p in ps.values() if p.grad is not None]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=tp)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


data, recent = batch_of_sequences(), []
with tec.debug.check_saved_tensors():                       # fails if anything saved aliases a userbuffer
    for step in range(args.steps):
        seqs = next(data)
        lo = rank * (S // tp_size)
        targets = seqs[1:][lo:lo + S // tp_size]
        logits = model(seqs[:-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / (S * B)
        loss.backward()                                     # this rank's share of the mean loss
        sync_grads()
        opt.step()
        opt.zero_grad()
        total = loss.detach()
        dist.all_reduce(total, group=tp)                    # the mean loss over all tokens
        recent.append(total.item())
        if step % 20 == 0 or step == args.steps - 1:
            if rank == 0:                                   # the mean since the last line
                print(f"step {step:4d}  loss {sum(recent) / len(recent):.4f}", flush=True)
            recent = []

if overlap:
    for name in tec.LAYER_NAMES:                            # which overlapped paths ran, per communicator
        ran = {k: v for k, v in tec.get_ub(name).stats().items()
               if k in ("ag_overlap", "rs_overlap", "bulk_ag", "bulk_rs") and v}
        if rank == 0 and ran:
            print(f"{name:<10} {ran}")
    tec.destroy_ub()
dist.destroy_process_group()
