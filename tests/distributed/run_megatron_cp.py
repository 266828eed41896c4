"""Megatron-Core's GPTModel (its TransformerEngine layer spec, with
`transformer_engine` resolving to this package) at context_parallel_size =
world size / --tp (tensor parallelism with sequence parallelism inside, at
--tp > 1), against the same model at context_parallel_size = 1 (same
tensor parallelism) on every rank, same weights and tokens:
  1. one step, for each cp_comm_type asked: the loss (each rank's tokens, summed over the group) and
     every parameter gradient (summed over the group, as Megatron's DDP
     sums them over the data- and context-parallel ranks) equal the CP=1
     model's over the whole sequence; with --packed also for packed
     sequences (thd, Megatron's PackedSeqParams) with the first comm type;
  2. training with Megatron's DDP and optimizer (the first comm type): the first step's main_grads
     equal the CP=1 gradients, the loss falls, and the parameters stay equal
     across the ranks.
Each rank holds chunks r and 2cp-1-r of the sequence (Megatron's
get_batch_on_this_cp_rank). --corrupt NAME scales that parameter's
gradient by 1.001 before the comparison (the run must then fail); every
run also checks that the comparison reports a gradient scaled so.
On CUDA (--device cuda: a GPU per rank, or TEC_SHARE_GPU=2) Megatron gives
the attention its cp_stream.
  torchrun --nproc_per_node=2 tests/distributed/run_megatron_cp.py [--cp-comm-types p2p,all_gather,a2a]
      [--device cuda] [--tp 2 (at 4 ranks)] [--packed]"""
import argparse
import dataclasses
import itertools
import os
import sys

import transformer_engine_c

transformer_engine_c.install_as_transformer_engine()  # before anything imports transformer_engine

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_gpt as mg  # noqa: E402
from common import rel_err, setup  # noqa: E402
from transformer_engine_c.attention.context_parallel import reset_stats, shard_sequence, shard_thd, stats  # noqa: E402

PACKED = (4, 8)  # packed sequence lengths (thd): multiples of 2 x cp at cp <= 2, within the position table


def build(tp, cp, dev, comm_type, grad_acc_fusion=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    config = dataclasses.replace(mg.transformer_config(tp, dev, tp > 1, grad_acc_fusion, True),
                                 context_parallel_size=cp, cp_comm_type=comm_type)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                    vocab_size=mg.VOCAB, max_sequence_length=mg.SEQ, position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=False).to(dev)


def local_loss(model, tokens, labels, cp, rank):
    """This rank's share of the mean per-token loss over the whole batch."""
    pos = torch.arange(mg.SEQ, device=tokens.device).unsqueeze(0).expand(mg.BATCH, mg.SEQ)
    if cp > 1:
        tokens, labels, pos = (shard_sequence(t, 1, cp, rank) for t in (tokens, labels, pos))
    per_token = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels)
    return per_token.float().sum() / (mg.BATCH * mg.SEQ)


def packed_loss(model, tokens, labels, cp, rank):
    """This rank's share of the mean per-token loss over packed sequences
    (thd: the batch's rows laid end to end, lengths PACKED): each sequence
    cut into 2 x cp chunks as TE cuts it, positions counted within each."""
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = torch.tensor([0, *itertools.accumulate(PACKED)], dtype=torch.int32)
    flat_tokens, flat_labels = tokens.reshape(-1)[:cu[-1]], labels.reshape(-1)[:cu[-1]]
    pos = torch.cat([torch.arange(n) for n in PACKED]).to(tokens.device)
    if cp > 1:
        flat_tokens, flat_labels, pos = (shard_thd(t, cu, cp, rank) for t in (flat_tokens, flat_labels, pos))
    cu_dev = cu.to(tokens.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_dev, cu_seqlens_kv=cu_dev, cu_seqlens_q_padded=cu_dev,
                             cu_seqlens_kv_padded=cu_dev, max_seqlen_q=max(PACKED), max_seqlen_kv=max(PACKED))
    per_token = model(input_ids=flat_tokens.unsqueeze(0), position_ids=pos.unsqueeze(0), attention_mask=None,
                      labels=flat_labels.unsqueeze(0), packed_seq_params=params)
    return per_token.float().sum() / int(cu[-1])


def compare_grads(grads, ref_grads, what):
    """(errors, (largest relative error, its parameter)) of gradients
    against the CP=1 model's."""
    errors, worst = [], (0.0, None)
    for n, g in grads.items():
        e = rel_err(g, ref_grads[n])
        worst = max(worst, (e, n), key=lambda t: t[0])
        if e > mg.TOL:
            errors.append(f"{what}: {n} gradient relative error {e:.3g} > {mg.TOL} against CP=1")
    return errors, worst


def step_at_cp(model, loss_fn, ref_loss, label, errors):
    """One forward and backward of `model` at CP>1 (the paths' counts reset
    first): its loss summed over the context-parallel group, checked against
    `ref_loss` (CP=1) into `errors`, and its gradients summed over the group."""
    from megatron.core import parallel_state
    cp_group = parallel_state.get_context_parallel_group()
    reset_stats()
    loss = loss_fn(model)
    loss.backward()
    mg.reduce_sequence_parallel_grads(model, parallel_state.get_tensor_model_parallel_group())
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    if abs(total.item() - ref_loss.item()) > 1e-5 * abs(ref_loss.item()):
        errors.append(f"{label}: loss {total.item():.7f} vs {ref_loss.item():.7f} at CP=1")
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = p.grad.detach().clone()
        dist.all_reduce(grads[n], group=cp_group)
    return total, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp-comm-types", default="p2p,all_gather,a2a")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--packed", action="store_true", help="also packed sequences (thd, PackedSeqParams)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (with sequence parallelism); "
                    "context-parallel size = world size / tp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--corrupt", default=None)
    args = ap.parse_args()
    rank, world, dev = setup(args.device)
    torch.set_default_device("cpu")  # what Megatron makes without a device is made on the CPU and moved
    if dev.type == "cpu":
        mg.cpu_workarounds()
    mg.apex_wgrad_stand_in()
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    tp, cp = args.tp, world // args.tp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    mg.seed_like_megatron()
    cp_group = parallel_state.get_context_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    crank = dist.get_rank(cp_group)
    errors = []

    kinds = args.cp_comm_types.split(",")
    whole = build(tp, 1, dev, kinds[0])
    mg.perturb_norms(whole, seed=7)
    state = {k: v.detach().clone() for k, v in whole.state_dict().items() if not k.endswith("_extra_state")}
    tokens, labels = mg.batch(dev)
    ref_loss = local_loss(whole, tokens, labels, 1, crank)
    ref_loss.backward()
    mg.reduce_sequence_parallel_grads(whole, tp_group)
    ref_grads = {n: p.grad.detach().clone() for n, p in whole.named_parameters()}

    # 1. one step against CP=1
    for kind in kinds:
        model = build(tp, cp, dev, kind)
        model.load_state_dict(state, strict=False)
        total, grads = step_at_cp(model, lambda m: local_loss(m, tokens, labels, cp, crank), ref_loss, kind, errors)
        if args.corrupt in grads:
            grads[args.corrupt].mul_(1.001)
        found, worst = compare_grads(grads, ref_grads, kind)
        errors += found
        if kind == kinds[0]:  # the comparison's negative test: a gradient 0.1% off must be reported
            name = "decoder.layers.1.self_attention.linear_qkv.weight"
            off = dict(grads, **{name: grads[name] * 1.001})
            if not any(name in e for e in compare_grads(off, ref_grads, kind)[0]):
                errors.append(f"the comparison did not report {name} scaled by 1.001")
            elif rank == 0:
                print(f"negative check: {name} scaled by 1.001 is reported", flush=True)
        if rank == 0:
            print(f"CP={cp} TP={tp} {kind}: loss {total.item():.6f} (CP=1 {ref_loss.item():.6f}); {len(ref_grads)} "
                  f"gradients, largest relative error {worst[0]:.3g} ({worst[1]}); paths {stats()}", flush=True)
        del model

    # 1b. packed sequences (thd) through Megatron's PackedSeqParams, against CP=1
    if args.packed:
        for n, p in whole.named_parameters():
            p.grad = None
        ref = packed_loss(whole, tokens, labels, 1, crank)
        ref.backward()
        mg.reduce_sequence_parallel_grads(whole, tp_group)
        ref_packed = {n: p.grad.detach().clone() for n, p in whole.named_parameters()}
        model = build(tp, cp, dev, kinds[0])
        model.load_state_dict(state, strict=False)
        total, grads = step_at_cp(model, lambda m: packed_loss(m, tokens, labels, cp, crank), ref,
                                  f"packed {kinds[0]}", errors)
        found, worst = compare_grads(grads, ref_packed, f"packed {kinds[0]}")
        errors += found
        if rank == 0:
            print(f"packed CP={cp} TP={tp} {kinds[0]}: loss {total.item():.6f} (CP=1 {ref.item():.6f}); largest "
                  f"relative error {worst[0]:.3g} ({worst[1]}); paths {stats()}", flush=True)
        del model

    # 2. Megatron's DDP + optimizer over the context-parallel ranks
    model = build(tp, cp, dev, kinds[0], grad_acc_fusion=True)
    model.load_state_dict(state, strict=False)
    ddp, opt = mg.ddp_and_optimizer(model)
    losses = []
    for step in range(args.steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = local_loss(ddp, tokens, labels, cp, crank)
        (loss * cp).backward()  # Megatron's loss_func scales by cp size; DDP averages over the cp ranks
        finalize_model_grads([ddp])
        if step == 0:
            for n, p in model.named_parameters():
                e = rel_err(p.main_grad, ref_grads[n])
                if e > mg.TOL:
                    errors.append(f"DDP main_grad {n}: relative error {e:.3g} > {mg.TOL} against CP=1")
        ok, _, _ = opt.step()
        if not ok:
            errors.append(f"step {step}: the optimizer skipped its update")
        total = loss.detach().clone()
        dist.all_reduce(total, group=cp_group)
        losses.append(total.item())
    if rank == 0:
        print("losses", [round(v, 5) for v in losses], flush=True)
    if not losses[-1] < losses[0] - 1e-3:
        errors.append(f"the loss did not fall over {args.steps} steps: {losses}")
    errors += mg.same_on_every_rank([(n, p.detach()) for n, p in model.named_parameters()], cp_group,
                                    "parameters after training")
    dist.barrier()
    if errors:
        print(f"rank {rank} FAIL:\n  " + "\n  ".join(errors), flush=True)
        sys.exit(1)
    if rank == 0:
        print(f"PASS run_megatron_cp (CP={cp}, TP={tp}, {args.cp_comm_types}, {dev.type})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
