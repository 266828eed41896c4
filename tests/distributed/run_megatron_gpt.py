"""Megatron-Core's own GPTModel, built from its TransformerEngine layer spec
with `transformer_engine` resolving to this package (the opt-in alias and
nothing else), under torchrun: TP = world size with sequence parallelism
(gloo on the CPU, or one CUDA device per rank / ranks sharing one).
  0. the inputs and the replicated parameters are the same on every rank
     (the reference is computed from this rank's copy of the replicated
     ones), and so is the reference loss;
  1. loss and every parameter gradient against a float64 plain-PyTorch
     reference computed from the gathered weights (tests/megatron_gpt.py);
     the gradient furthest from the reference is printed, pass or fail;
  2. a few steps of Megatron's DDP (gradient-accumulation fusion into its
     main_grad buffers) + Megatron's optimizer: the first step's main_grads
     match the reference, the loss falls, replicated parameters stay equal
     across the tensor-parallel ranks.
Megatron's CUDA assumptions on a CPU run, and its APEX extension for the
output layer's gradient-accumulation fusion, are worked around here only
(megatron_gpt.cpu_workarounds and apex_wgrad_stand_in say what each is).
--init cpu is Megatron's use_cpu_initialization (a CPU run's default),
--init device the layers' own initialisation on the run's device under the
per-TP-rank RNG fork (a CUDA run's default; on the CPU it runs the path a
CUDA run takes).
  torchrun --nproc_per_node=2 tests/distributed/run_megatron_gpt.py [--device cuda] [--init cpu|device]"""
import argparse
import os
import sys

import transformer_engine_c

transformer_engine_c.install_as_transformer_engine()  # before anything imports transformer_engine

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_gpt as mg  # noqa: E402
from common import setup  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--corrupt", default=None,
                    help="scale this parameter's gradient by 1.001 before the comparison (the checker's "
                         "negative test: the run must fail naming it)")
    ap.add_argument("--init", default=None, choices=["cpu", "device"],
                    help="cpu: use_cpu_initialization; device: each layer initialises its shard on the run's "
                         "device (default: cpu on a CPU run, device on CUDA)")
    ap.add_argument("--skip-cpu-seed", action="store_true",
                    help="seed only as Megatron-Core does (model_parallel_cuda_manual_seed), not the CPU "
                         "generator (the replicated-parameter check's negative test: the run must fail "
                         "naming the position embeddings)")
    args = ap.parse_args()
    rank, world, dev = setup(args.device)
    torch.set_default_device("cpu")  # what Megatron makes without a device is made on the CPU and moved
    if dev.type == "cpu":
        mg.cpu_workarounds()
    mg.apex_wgrad_stand_in()
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    if args.skip_cpu_seed:
        model_parallel_cuda_manual_seed(mg.SEED, te_rng_tracker=True)
    else:
        mg.seed_like_megatron()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    init = args.init or ("cpu" if dev.type == "cpu" else "device")
    cpu_init = init == "cpu"

    errors = []
    # 0. what the reference assumes every rank shares
    model = mg.build_model(world, dev, sequence_parallel=world > 1, grad_acc_fusion=False, cpu_init=cpu_init)
    mg.perturb_norms(model, seed=7)
    tokens, labels = mg.batch(dev)
    errors += mg.same_on_every_rank([("tokens", tokens), ("labels", labels)], tp_group, "inputs")
    errors += mg.replicated_equal(model, tp_group, "before the first step")
    # 1. a plain forward/backward (no DDP) against the float64 reference
    loss = mg.megatron_loss(model, tokens, labels)
    loss.backward()
    mg.reduce_sequence_parallel_grads(model, tp_group)
    if args.corrupt:
        dict(model.named_parameters())[args.corrupt].grad.mul_(1.001)
    full = mg.gather_params(model, tp_group)
    ref_loss, ref_grads = mg.reference_loss_and_grads(full, tokens.cpu(), labels.cpu())
    errors += mg.same_on_every_rank([("loss", ref_loss.reshape(1).to(dev))], tp_group, "reference")
    found, summary = mg.compare(model, loss, ref_loss, ref_grads, tp_group, grad_of=lambda p: p.grad, what="plain")
    errors += found
    names = [n for n, _ in model.named_parameters()]
    if rank == 0:
        print(f"compared loss and {len(names)} parameter gradients; loss {loss.item():.6f} "
              f"(reference {ref_loss.item():.6f}); init {init}", flush=True)
        print(summary, flush=True)

    # 2. Megatron's DDP + optimizer, starting from the same weights
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    del model
    model = mg.build_model(world, dev, sequence_parallel=world > 1, grad_acc_fusion=True, cpu_init=cpu_init)
    missing = model.load_state_dict(state, strict=False)
    assert not missing.missing_keys or all(k.endswith("_extra_state") for k in missing.missing_keys), missing
    ddp, opt = mg.ddp_and_optimizer(model)
    losses = []
    for step in range(args.steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = mg.megatron_loss(ddp, tokens, labels)
        loss.backward()
        finalize_model_grads([ddp])  # DP reduction and the sums of the sequence-parallel parameters' grads
        if step == 0:
            found, summary = mg.compare(model, loss, ref_loss, ref_grads, tp_group, grad_of=lambda p: p.main_grad,
                                        what="DDP main_grad")
            errors += found
            if rank == 0:
                print(summary, flush=True)
        ok, _, _ = opt.step()
        assert ok, f"step {step}: the optimizer skipped its update"
        losses.append(loss.item())
    if rank == 0:
        print("losses", [round(v, 5) for v in losses], flush=True)
    if not losses[-1] < losses[0] - 1e-3:
        errors.append(f"the loss did not fall over {args.steps} steps: {losses}")
    errors += mg.replicated_equal(model, tp_group, "after training")

    dist.barrier()
    if errors:
        print(f"rank {rank} FAIL:\n  " + "\n  ".join(errors), flush=True)
        sys.exit(1)
    if rank == 0:
        print(f"PASS run_megatron_gpt (TP={world}, {dev.type})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
