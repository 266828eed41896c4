"""torchrun runner: context parallelism. Every configuration runs
DotProductAttention with a cp_group over this rank's shard (chunks r and
2cp-1-r of each sequence) and compares the output and the query, key and
value gradients, row for row, with DotProductAttention over the whole
sequence on one rank (float64, from the same inputs). Configurations: every
cp_comm_type (a2a+p2p as 2 x 2 at four ranks; at two as a2a 2 x p2p 1 and
a2a 1 x p2p 2 in turn), formats sbhd/bshd/thd, masks causal/no_mask,
sliding windows, GQA, a value head size other than the query's, fp32, bf16
and fp16, and thd with padding after each sequence (on CUDA the bshd and
thd ones exchange on a cp_stream). Then TransformerLayer
(rotary embeddings at each shard's positions) and MultiheadAttention over
padded thd against the same layers without context parallelism, attention
dropout (the same seed the same output; the backward the forward's
derivative, against a central difference), the bad
inputs that must raise, and a peer that never answers (the wait must time
out naming it). Prints "PASS run_cp".

    torchrun --nproc_per_node=2 tests/distributed/run_cp.py [--device cuda] [--break-layout]

--break-layout shards the inputs as contiguous slices instead of the
balanced chunks the attention assumes: the comparison must fail (the
checker's negative test)."""
import argparse
import itertools
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c.attention import context_parallel as cp  # noqa: E402
from common import compare, rel_err, setup  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def tolerance_error(name, out, ref):
    """fp32: 1e-5 relative error of the whole tensor; bf16/fp16: TE's
    context-parallel attention test's rtol 0.025 / atol 0.025 at the worst
    element (a gradient of attention in 16 bits rounds its saved output, and
    the backward subtracts the output's share from each probability). An
    error or None."""
    if out.dtype == torch.float32:
        err = rel_err(out, ref)
        return None if err <= 1e-5 else f"{name}: relative error {err:.3g} > 1e-05"
    return compare(name, out, ref, rtol=0.025, atol=0.025)


class Groups:
    """The context-parallel groups of this world: the whole world, and for
    a2a+p2p the a2a groups (consecutive ranks) and p2p groups across them."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.all = dist.new_group(list(range(world)))
        self.last = dist.new_group(list(range(world)))  # untouched by the timeout case
        self.hier = {}
        for a2a in sorted({1, 2} & {d for d in range(1, world + 1) if world % d == 0}):
            p2p = world // a2a
            mine = []
            for p in range(p2p):  # a2a groups: ranks p*a2a .. p*a2a + a2a - 1
                ranks = [p * a2a + a for a in range(a2a)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    mine.append(g)
            for a in range(a2a):  # p2p groups: ranks a, a + a2a, ...
                ranks = [p * a2a + a for p in range(p2p)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    mine.append(g)
            self.hier[a2a] = mine

    def args(self, kind, a2a=2):
        if kind == "a2a+p2p":
            return self.hier[a2a], list(range(self.world))
        return self.all, list(range(self.world))


def shard(t, fmt, cu, size, rank, broken):
    """This rank's share of whole-sequence tensor t (in fmt)."""
    if fmt == "thd":
        if broken:
            n = t.shape[0] // size
            return t[rank * n:(rank + 1) * n]
        return cp.shard_thd(t, cu, size, rank)
    dim = 0 if fmt == "sbhd" else 1
    if broken:
        return t.chunk(size, dim)[rank]
    return cp.shard_sequence(t, dim, size, rank)


def attention_case(groups, dev, kind, fmt, mask, dtype_name, heads, groups_kv, d, dv, window, checkpoint=False, *,
                   broken, a2a=2, padded=False):
    size, rank = groups.world, groups.rank
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, fmt, mask, dtype_name, heads, d, dv, window)).encode()))
    B, S = 2, 4 * size
    cu = cu_actual = None
    if fmt == "thd":
        lens = [2 * size, 6 * size, 4 * size]
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
        if padded:  # sequences shorter than the room each has (padding after each)
            actual = [n - short for n, short in zip(lens, (1, 3, 0))]
            cu_actual = torch.tensor([0] + list(itertools.accumulate(actual)), dtype=torch.int32)
        shape_q, shape_k, shape_v = ((sum(lens), heads, d), (sum(lens), groups_kv, d), (sum(lens), groups_kv, dv))
    else:
        lead = (S, B) if fmt == "sbhd" else (B, S)
        shape_q, shape_k, shape_v = ((*lead, heads, d), (*lead, groups_kv, d), (*lead, groups_kv, dv))
    q, k, v = (torch.randn(s, generator=gen, device="cpu").to(dtype) for s in (shape_q, shape_k, shape_v))
    out_shape = (*shape_q[:-2], heads * dv)
    dout = torch.randn(out_shape, generator=gen, device="cpu").to(dtype)
    kw = dict(qkv_format=fmt, attn_mask_type=mask, window_size=window, attention_dropout=0.0)
    if fmt == "thd" and padded:
        fkw = dict(cu_seqlens_q=cu_actual.to(dev), cu_seqlens_kv=cu_actual.to(dev), cu_seqlens_q_padded=cu.to(dev),
                   cu_seqlens_kv_padded=cu.to(dev))
    elif fmt == "thd":
        fkw = dict(cu_seqlens_q=cu.to(dev), cu_seqlens_kv=cu.to(dev))
    else:
        fkw = {}

    # one rank, the whole sequence, float64
    ref_mod = tec.DotProductAttention(heads, (d, dv), num_gqa_groups=groups_kv, **kw)
    qr, kr, vr = (t.to(dev, torch.float64).requires_grad_() for t in (q, k, v))
    ref = ref_mod(qr, kr, vr, **fkw)
    ref.backward(dout.to(dev, torch.float64))

    cp_group, cp_ranks = groups.args(kind, a2a)
    stream = torch.cuda.Stream() if dev.type == "cuda" and fmt != "sbhd" else None  # both ways on CUDA
    mod = tec.DotProductAttention(heads, (d, dv), num_gqa_groups=groups_kv, cp_group=cp_group,
                                  cp_global_ranks=cp_ranks, cp_stream=stream, cp_comm_type=kind, **kw)
    parts = [shard(t, fmt, cu, size, rank, broken) for t in (q, k, v, dout)]
    ql, kl, vl = (t.to(dev).requires_grad_() for t in parts[:3])
    out = mod(ql, kl, vl, checkpoint_core_attention=checkpoint, **fkw)
    out.backward(parts[3].to(dev))
    name = (f"{kind} {fmt}{' padded' if padded else ''} {mask} {dtype_name} h{heads}/{groups_kv} d{d}/{dv} "
            f"window {window}{' checkpointed' if checkpoint else ''}")
    errors = []
    for what, got, want in (("output", out, ref), ("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                            ("dv", vl.grad, vr.grad)):
        if got is None or got.dtype != dtype:
            errors.append(f"{name}: {what} is {None if got is None else got.dtype}, expected {dtype}")
            continue
        e = tolerance_error(f"{name}: {what}", got, shard(want.detach().cpu(), fmt, cu, size, rank, broken))
        if e:
            errors.append(e)
    return errors


def attention_cases(world):
    """The configurations: every comm type x format x mask, with dtypes,
    head layouts and windows drawn in turn so that each appears with each
    comm type."""
    kinds = ["p2p", "all_gather", "a2a", "a2a+p2p"]
    heads = [(4, 4, 8, 8), (4, 2, 8, 12), (4, 1, 8, 8) if world == 2 else (8, 4, 8, 8), (4, 2, 16, 8)]
    dtypes = ["fp32", "bf16", "fp16"]
    i = 0
    for kind in kinds:
        for fmt in ("sbhd", "bshd", "thd"):
            if fmt == "thd" and kind in ("a2a", "a2a+p2p"):
                continue
            for mask in ("causal", "no_mask"):
                h, hk, d, dv = heads[i % len(heads)]
                need = world if kind == "a2a" else 2  # the a2a group's size divides both head counts
                if kind in ("a2a", "a2a+p2p") and (h % need or hk % need):
                    h, hk = 2 * need, need
                window = None
                if i % 3 == 2:
                    window = (3, 0) if mask == "causal" else (3, 2)
                yield kind, fmt, mask, dtypes[i % len(dtypes)], h, hk, d, dv, window
                i += 1
    yield "p2p", "bshd", "causal_bottom_right", "fp32", 4, 2, 8, 8, None  # the same diagonal here
    for dtype in dtypes:  # every dtype on the ring's causal sbhd, recomputed in backward
        yield "p2p", "sbhd", "causal", dtype, 4, 2, 8, 8, None, True


def padded_thd_cases():
    """thd with padding after each sequence (cu_seqlens_*_padded), TE's thd masks."""
    yield "p2p", "thd", "padding_causal", "fp32", 4, 2, 8, 12, None
    yield "p2p", "thd", "padding", "bf16", 4, 2, 8, 8, (2, 1)
    yield "all_gather", "thd", "padding_causal", "fp32", 4, 1, 8, 8, None
    yield "p2p", "thd", "padding_causal_bottom_right", "fp32", 4, 2, 8, 8, None


def transformer_layer_case(groups, dev, kind):
    """TransformerLayer (rotary embeddings, GQA) with the cp group against
    the same layer over the whole sequence: output, input gradient, and every
    parameter gradient summed over the group."""
    size, rank = groups.world, groups.rank
    S, B, H, HEADS = 4 * size, 2, 32, 2 * size  # a2a: the group's size divides the head counts
    torch.manual_seed(11)
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, num_gqa_groups=size, params_dtype=torch.float32,
              device=dev, self_attn_mask_type="causal")
    full = tec.TransformerLayer(H, 64, HEADS, **kw)
    part = tec.TransformerLayer(H, 64, HEADS, **kw)
    part.load_state_dict(full.state_dict())
    cp_group, cp_ranks = groups.args(kind)
    part.set_context_parallel_group(cp_group, cp_ranks, None, kind)
    rope = tec.RotaryPositionEmbedding(H // HEADS)
    freqs = rope(S).to(dev)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(S, B, H, generator=gen, device="cpu").to(dev)
    dy = torch.randn(S, B, H, generator=gen, device="cpu").to(dev)
    xf = x.clone().requires_grad_()
    full(xf, rotary_pos_emb=freqs).backward(dy)
    xl = cp.shard_sequence(x, 0, size, rank).requires_grad_()
    y = part(xl, rotary_pos_emb=freqs)
    y.backward(cp.shard_sequence(dy, 0, size, rank))
    return layer_errors(f"TransformerLayer {kind}", groups, full, part,
                        (("output", y, cp.shard_sequence(full(x, rotary_pos_emb=freqs), 0, size, rank)),
                         ("input grad", xl.grad, cp.shard_sequence(xf.grad, 0, size, rank))))


def layer_errors(name, groups, full, part, pairs):
    """What differs beyond tolerance: each (what, got, want) of `pairs`, then
    each parameter's gradient of `part` summed over the group against
    `full`'s."""
    errors = []
    for what, got, want in pairs:
        e = tolerance_error(f"{name}: {what}", got, want)
        if e:
            errors.append(e)
    grads = dict(full.named_parameters())
    for n, p in part.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=groups.all)
        e = tolerance_error(f"{name}: {n} gradient", g, grads[n].grad)
        if e:
            errors.append(e)
    return errors


def multihead_thd_case(groups, dev):
    """MultiheadAttention over packed sequences with padding after each
    (thd, padding_causal, rotary embeddings at the padded offsets) with the
    p2p group, against the same layer over the whole batch."""
    size, rank = groups.world, groups.rank
    H, HEADS = 32, 2 * size
    lens = [2 * size, 6 * size]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    actual = torch.tensor([0] + list(itertools.accumulate([lens[0] - 1, lens[1] - 2])), dtype=torch.int32)
    torch.manual_seed(12)
    kw = dict(attention_dropout=0.0, num_gqa_groups=size, params_dtype=torch.float32, device=dev,
              qkv_format="thd", attn_mask_type="padding_causal", input_layernorm=True)
    full = tec.MultiheadAttention(H, HEADS, **kw)
    part = tec.MultiheadAttention(H, HEADS, **kw)
    part.load_state_dict(full.state_dict())
    part.set_context_parallel_group(groups.all, list(range(size)), None, "p2p")
    freqs = tec.RotaryPositionEmbedding(H // HEADS)(max(lens)).to(dev)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(sum(lens), H, generator=gen, device="cpu").to(dev)
    dy = torch.randn(sum(lens), H, generator=gen, device="cpu").to(dev)
    fkw = dict(rotary_pos_emb=freqs, cu_seqlens_q=actual.to(dev), cu_seqlens_kv=actual.to(dev),
               cu_seqlens_q_padded=cu.to(dev), cu_seqlens_kv_padded=cu.to(dev), pad_between_seqs=True)
    xf = x.clone().requires_grad_()
    yf = full(xf, **fkw)
    yf.backward(dy)
    xl = cp.shard_thd(x, cu, size, rank).requires_grad_()
    y = part(xl, **fkw)
    y.backward(cp.shard_thd(dy, cu, size, rank))
    return layer_errors("MultiheadAttention thd padded", groups, full, part,
                        (("output", y, cp.shard_thd(yf.detach(), cu, size, rank)),
                         ("input grad", xl.grad, cp.shard_thd(xf.grad, cu, size, rank))))


def dropout_case(groups, dev, kind):
    """Attention dropout under context parallelism: the same seed gives the
    same output, the output is not the one without dropout, and the
    backward is the forward's derivative (the masks it redraws are the
    forward's): the gradients' inner product with a random direction against
    the central difference of the loss along it, summed over the group."""
    size, rank = groups.world, groups.rank
    errors = []
    name = f"dropout {kind}"
    m = tec.DotProductAttention(2 * size, 8, num_gqa_groups=size, qkv_format="sbhd", attention_dropout=0.3,
                                cp_group=groups.all, cp_global_ranks=list(range(size)), cp_comm_type=kind)
    gen = torch.Generator().manual_seed(21)
    S, B = 4 * size, 2
    full = [torch.randn(S, B, h, 8, generator=gen, device="cpu") for h in (2 * size, size, size)]
    w_full = torch.randn(S, B, 2 * size * 8, generator=gen, device="cpu")
    u_full = [torch.randn(t.shape, generator=gen, device="cpu") for t in full]
    q, k, v, w, *u = (cp.shard_sequence(t, 0, size, rank).to(dev) for t in (*full, w_full, *u_full))

    def loss(shift=0.0, grad=False):
        torch.manual_seed(99)
        args = [(t + shift * d).requires_grad_(grad) for t, d in zip((q, k, v), u)]
        val = (m(*args) * w).sum()
        return val, args

    base, args = loss(grad=True)
    base.backward()
    again, _ = loss()
    if not torch.equal(base.detach(), again.detach()):
        errors.append(f"{name}: the same seed gave another output")
    m.eval()
    plain = (m(q, k, v) * w).sum()
    m.train()
    if abs(plain.item() - base.item()) < 1e-3 * abs(plain.item()):
        errors.append(f"{name}: the output is the one without dropout ({base.item()} vs {plain.item()})")
    eps = 1e-2
    sums = torch.tensor([sum((a.grad * d).sum().item() for a, d in zip(args, u)),
                         (loss(eps)[0].item() - loss(-eps)[0].item()) / (2 * eps)], dtype=torch.float64,
                        device=dev)
    dist.all_reduce(sums, group=groups.all)
    analytic, numeric = sums.tolist()
    if abs(analytic - numeric) > 2e-3 * max(abs(numeric), 1.0):
        errors.append(f"{name}: gradient along a direction {analytic:.6f}, central difference {numeric:.6f}")
    return errors


def expect_error(errors, what, exc, needle, fn):
    try:
        fn()
    except exc as e:
        if needle not in str(e):
            errors.append(f"bad input {what}: {type(e).__name__} without {needle!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001 (the wrong kind of exception is itself the finding)
        errors.append(f"bad input {what}: {type(e).__name__} instead of {exc.__name__}: {e}")
        return
    errors.append(f"bad input {what}: no exception")


def bad_inputs(groups, dev):
    size = groups.world
    errors = []
    dpa = tec.DotProductAttention
    g, ranks = groups.args("p2p")
    expect_error(errors, "cp_comm_type", ValueError, "cp_comm_type must be one of",
                 lambda: dpa(4, 8, cp_group=g, cp_global_ranks=ranks, cp_comm_type="ring"))
    expect_error(errors, "cp_global_ranks", ValueError, "cp_global_ranks",
                 lambda: dpa(4, 8, cp_group=g, cp_global_ranks=list(reversed(ranks))))
    expect_error(errors, "cp_global_ranks length", ValueError, "does not match cp_group",
                 lambda: dpa(4, 8, cp_group=g, cp_global_ranks=ranks[:-1]))
    expect_error(errors, "a2a+p2p single group", ValueError, "cp_group must be a pair",
                 lambda: dpa(4, 8, cp_group=g, cp_global_ranks=ranks, cp_comm_type="a2a+p2p"))
    expect_error(errors, "list for p2p", ValueError, "only cp_comm_type='a2a+p2p'",
                 lambda: dpa(4, 8, cp_group=[g, g], cp_global_ranks=ranks, cp_comm_type="p2p"))
    m = dpa(4, 8, cp_group=g, cp_global_ranks=ranks, qkv_format="bshd")
    x = torch.randn(1, 3, 4, 8, device=dev)
    expect_error(errors, "odd local sequence", ValueError, "must be two equal chunks", lambda: m(x, x, x))
    x = torch.randn(1, 4, 4, 8, device=dev)
    for mt in ("padding_causal", "arbitrary", "padding"):
        expect_error(errors, f"mask {mt}", NotImplementedError, f"attn_mask_type={mt!r}",
                     lambda: m(x, x, x, attn_mask_type=mt,
                               attention_mask=torch.zeros(1, 1, 1, 4, dtype=torch.bool, device=dev)))
    a2a = dpa(4, 8, cp_group=g, cp_global_ranks=ranks, qkv_format="thd", cp_comm_type="a2a")
    cu = torch.tensor([0, 4 * size], dtype=torch.int32, device=dev)
    t = torch.randn(4, 4, 8, device=dev)
    expect_error(errors, "thd with a2a", NotImplementedError, "qkv_format='thd' is not supported",
                 lambda: a2a(t, t, t, cu_seqlens_q=cu, cu_seqlens_kv=cu))
    thd = dpa(4, 8, cp_group=g, cp_global_ranks=ranks, qkv_format="thd")
    cu_bad = torch.tensor([0, 2 * size + 1, 4 * size + 2], dtype=torch.int32, device=dev)
    expect_error(errors, "thd length", ValueError, "must be a multiple of 2 x",
                 lambda: thd(t, t, t, cu_seqlens_q=cu_bad, cu_seqlens_kv=cu_bad))
    heads3 = dpa(3, 8, cp_group=g, cp_global_ranks=ranks, cp_comm_type="a2a", qkv_format="bshd")
    x3 = torch.randn(1, 4, 3, 8, device=dev)
    expect_error(errors, "a2a heads", ValueError, "must each divide", lambda: heads3(x3, x3, x3))
    return errors


def timeout_case(groups, dev):
    """Rank 0 attends over a p2p group whose other ranks never send: its
    wait must end with ContextParallelTimeout naming the peer and the step."""
    errors = []
    if groups.rank == 0:
        os.environ["TEC_COMM_TIMEOUT"] = "2"
        m = tec.DotProductAttention(4, 8, cp_group=groups.all, cp_global_ranks=list(range(groups.world)),
                                    qkv_format="bshd")
        del os.environ["TEC_COMM_TIMEOUT"]
        x = torch.randn(1, 4, 4, 8, device=dev)
        t0 = time.monotonic()
        expect_error(errors, "silent peer", cp.ContextParallelTimeout, "forward key/value step 0: receive from rank "
                     f"{groups.world - 1}", lambda: m(x, x, x))
        if time.monotonic() - t0 > 30:
            errors.append(f"silent peer: the timeout took {time.monotonic() - t0:.0f} s")
    return errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--break-layout", action="store_true")
    args = ap.parse_args()
    rank, world, dev = setup(args.device)
    torch.set_default_device("cpu")
    groups = Groups(world, rank)
    errors = []
    count = 0
    cp.reset_stats()
    for case in attention_cases(world):
        kind = case[0]
        a2a = 2 if world >= 4 or kind != "a2a+p2p" else 1
        if kind == "a2a+p2p" and world == 2:
            a2a = 2 if count % 2 else 1  # at two ranks: a2a 2 x p2p 1, or a2a 1 x p2p 2
        errors += attention_case(groups, dev, *case, broken=args.break_layout, a2a=a2a)
        count += 1
    for case in padded_thd_cases():
        errors += attention_case(groups, dev, *case, broken=args.break_layout, padded=True)
        count += 1
    seen = cp.stats()
    if not args.break_layout:
        for kind in ("p2p", "all_gather", "a2a"):
            errors += transformer_layer_case(groups, dev, kind)
        errors += multihead_thd_case(groups, dev)
        for kind in ("p2p", "all_gather", "a2a"):
            errors += dropout_case(groups, dev, kind)
        errors += bad_inputs(groups, dev)
        if not all(seen[k] for k in ("p2p_overlapped", "all_gather", "a2a", "fused_blocks", "math_blocks")):
            errors.append(f"a path did not run: {seen}")
    dist.barrier()
    if not args.break_layout:
        errors += timeout_case(groups, dev)
    dist.barrier(group=groups.last)  # the silent peers stay alive until rank 0 has timed out
    if errors:
        print(f"rank {rank} FAIL ({len(errors)}):\n  " + "\n  ".join(errors[:40]), flush=True)
        os._exit(1)
    if rank == 0:
        print(f"compared {count} attention configurations; paths {seen}", flush=True)
        print(f"PASS run_cp (CP={world}, {dev.type})", flush=True)
    sys.stdout.flush()
    os._exit(0)  # rank 0's timed-out exchange is never matched: skip the process group's teardown


if __name__ == "__main__":
    main()
