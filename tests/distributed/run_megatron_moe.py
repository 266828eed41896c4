"""Megatron-Core's mixture-of-experts GPT through the `transformer_engine`
alias, under torchrun (TP = EP = world size, sequence parallel, gloo):
the TE spec's grouped experts (TEGroupedMLP over this package's
GroupedLinear) with Megatron's fused router (this package's router
functions), against the same weights in Megatron's own plain path
(SequentialMLP of TE linear experts, Megatron's unfused PyTorch router and
aux loss): the loss and every gradient must agree.
  torchrun --nproc_per_node=2 tests/distributed/run_megatron_moe.py"""
import dataclasses
import os
import re
import sys

import transformer_engine_c

transformer_engine_c.install_as_transformer_engine()  # before anything imports transformer_engine

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_gpt as mg  # noqa: E402
from common import setup  # noqa: E402

EXPERTS = 4


def build(world, grouped):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    base = mg.transformer_config(world, torch.device("cpu"), sequence_parallel=world > 1, grad_acc_fusion=False)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields.update(add_bias_linear=False, num_moe_experts=EXPERTS, moe_router_topk=2, moe_grouped_gemm=grouped,
                  moe_router_fusion=grouped, moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=32,
                  moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss",
                  expert_model_parallel_size=world, expert_tensor_parallel_size=1)
    config = type(base)(**fields)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=mg.VOCAB, max_sequence_length=mg.SEQ,
                    position_embedding_type="learned_absolute")


def sequential_name(name):
    """The grouped model's parameter name in the sequential model."""
    m = re.match(r"(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$", name)
    return f"{m.group(1)}local_experts.{m.group(3)}.{m.group(2)}.weight" if m else name


def main():
    # --break-aux-loss (the comparison's negative test): the fused path's aux
    # loss doubled; the router's gradients must then disagree
    broken = "--break-aux-loss" in sys.argv[1:]
    rank, world, dev = setup("cpu")
    torch.set_default_device("cpu")
    mg.cpu_workarounds()
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import TEGroupedLinear
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, expert_model_parallel_size=world,
                                             expert_tensor_parallel_size=1)
    mg.seed_like_megatron()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if broken:
        from megatron.core.transformer.moe import moe_utils
        fused = moe_utils.fused_moe_aux_loss
        moe_utils.fused_moe_aux_loss = lambda *a, **k: 2 * fused(*a, **k)
    grouped, plain = build(world, True), build(world, False)
    assert any(isinstance(m, TEGroupedLinear) for m in grouped.modules()), "the grouped model has no GroupedLinear"
    assert not any(isinstance(m, TEGroupedLinear) for m in plain.modules())
    state = {sequential_name(k): v for k, v in grouped.state_dict().items() if not k.endswith("_extra_state")}
    res = plain.load_state_dict(state, strict=False)  # the experts' _extra_state entries are per module
    assert not res.unexpected_keys and all(k.endswith("_extra_state") for k in res.missing_keys), res
    mg.perturb_norms(grouped, seed=5)
    mg.perturb_norms(plain, seed=5)
    tokens, labels = mg.batch(dev)
    results = []
    for model in (grouped, plain):
        loss = mg.megatron_loss(model, tokens, labels)
        loss.backward()
        mg.reduce_sequence_parallel_grads(model, tp_group)
        results.append((loss.detach(), {sequential_name(n): p.grad for n, p in model.named_parameters()}))
    (loss_g, grads_g), (loss_p, grads_p) = results
    errors = []
    if abs(loss_g.item() - loss_p.item()) > mg.TOL * abs(loss_p.item()):
        errors.append(f"loss {loss_g.item():.8f} (grouped, fused router) vs {loss_p.item():.8f} (Megatron's own)")
    if sorted(grads_g) != sorted(grads_p):
        errors.append(f"parameter sets differ: {sorted(set(grads_g) ^ set(grads_p))}")
    for n in sorted(set(grads_g) & set(grads_p)):
        a, b = grads_g[n], grads_p[n]
        if a is None or b is None:
            errors.append(f"{n}: no gradient ({'grouped' if a is None else 'plain'})")
            continue
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        if not err <= mg.TOL:
            errors.append(f"{n}: gradient relative error {err:.3g} > {mg.TOL}")
    dist.barrier()
    if errors:
        print(f"rank {rank} FAIL:\n  " + "\n  ".join(errors), flush=True)
        sys.exit(1)
    if rank == 0:
        print(f"compared loss {loss_g.item():.6f} and {len(grads_g)} gradients", flush=True)
        print(f"PASS run_megatron_moe (TP=EP={world})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
