"""torchrun runner: tec.TransformerLayer with tensor parallelism
(set_parallel_mode=True), with and without sequence parallelism, against the
single-process layer (tp_size=1) built from the gathered shards, fed the
whole sequence: output, input grad (and encoder_output's), every parameter
grad (the shards gathered back; the gradients of parameters carrying
`sequence_parallel` summed over the group first by
tec.allreduce_sequence_parallel_grads, as Megatron's finalize_model_grads
does). Cases: split and fused (per-group interleaved)
qkv, GQA, RoPE, decoder cross-attention, post-LN residuals (with
output_layernorm, and with a decoder), parallel_attention_mlp with RMSNorm and a gated
activation, and ub_tp_comm_overlap through the userbuffers registry (the
communicators' stats prove the overlapped paths ran). Prints
"PASS run_transformer_layer_tp".

    torchrun --nproc_per_node=2 tests/distributed/run_transformer_layer_tp.py [--device cuda]
"""
import argparse
import os
import sys
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: mlp_reference
import transformer_engine_c as tec  # noqa: E402
from common import close, init_ub, setup  # noqa: E402
from mlp_reference import GATED, fc1_global  # noqa: E402

S, B, H, HEADS = 4, 2, 32, 4  # S: sequence positions per rank
CASES = {
    "split qkv": dict(sequence_parallel=False),
    "split qkv sp": dict(),
    "fused interleaved gqa rope sp": dict(fuse_qkv_params=True, num_gqa_groups=2, rope=True),
    "decoder sp": dict(layer_type="decoder", rope=True),
    "post-LN output_layernorm sp": dict(apply_residual_connection_post_layernorm=True, output_layernorm=True),
    "post-LN decoder gqa sp": dict(apply_residual_connection_post_layernorm=True, layer_type="decoder",
                                   num_gqa_groups=2),
    "parallel_attention_mlp RMSNorm swiglu sp": dict(parallel_attention_mlp=True, normalization="RMSNorm",
                                                     activation="swiglu", bias=False),
    "ub_tp_comm_overlap sp": dict(ub_tp_comm_overlap=True),
}


def gather(t, dim, tp):
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim=dim)


def full_tensor(name, p, t, tp, gated):
    """The unsharded value of `t` (the parameter `p` named `name`, or its
    gradient): shards gathered along the partition dimension; fc1 of a gated
    activation rearranged into the one-rank layout."""
    if not getattr(p, "tensor_model_parallel", False):
        return t.detach()
    if gated and name.startswith("layernorm_mlp.fc1_"):
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous())
        return fc1_global(parts, True)
    return gather(t, p.partition_dim, tp)


def run_case(name, kw, rank, tp, dev):
    kw = dict(kw)
    rope = kw.pop("rope", False)
    sp = kw.pop("sequence_parallel", True)
    decoder = kw.get("layer_type") == "decoder"
    gated = kw.get("activation", "gelu") in GATED
    common = dict(hidden_dropout=0.0, attention_dropout=0.0, device=dev, **kw)
    torch.manual_seed(1234 + rank)  # different shards on every rank
    layer = tec.TransformerLayer(H, 2 * H, HEADS, set_parallel_mode=True, sequence_parallel=sp,
                                 tp_group=dist.group.WORLD, **common)
    with torch.no_grad():  # non-trivial norms and biases, the same on every rank where replicated
        for n, p in layer.named_parameters():
            if p.dim() == 1:
                # a CPU generator draws on the CPU (the default device is the rank's), the same values on any device
                g = torch.Generator().manual_seed(zlib.crc32(n.encode()) + (rank if getattr(
                    p, "tensor_model_parallel", False) else 0))
                v = torch.randn(p.shape, generator=g, device="cpu")
                p.copy_(v.to(p) * 0.1 + (1.0 if n.endswith("weight") else 0.0))
    common.pop("ub_tp_comm_overlap", None)
    ref = tec.TransformerLayer(H, 2 * H, HEADS, **common)
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(full_tensor(n, params[n], params[n], tp, gated))

    torch.manual_seed(99)  # the same whole-sequence data on every rank
    x = torch.randn(S * tp, B, H, device=dev)
    enc = torch.randn(S * tp, B, H, device=dev)
    dy = torch.randn(S * tp, B, H, device=dev)
    freqs = tec.RotaryPositionEmbedding(H // HEADS)(S * tp).to(dev) if rope else None

    def local(t):
        return t.chunk(tp)[rank].contiguous() if sp else t

    x_ref, enc_ref = x.clone().requires_grad_(), enc.clone().requires_grad_()
    y_ref = ref(x_ref, encoder_output=enc_ref if decoder else None, rotary_pos_emb=freqs)
    y_ref.backward(dy)

    x_loc, enc_loc = local(x).requires_grad_(), local(enc).requires_grad_()
    before = {n: tec.get_ub(n).stats() for n in ("qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop")} \
        if kw.get("ub_tp_comm_overlap") else None
    y = layer(x_loc, encoder_output=enc_loc if decoder else None, rotary_pos_emb=freqs)
    y.backward(local(dy))
    tec.allreduce_sequence_parallel_grads(layer)  # the output LayerNorm's too, over the layer's group

    close(y, local(y_ref), f"{name}: output")
    close(x_loc.grad, local(x_ref.grad), f"{name}: input grad")
    if decoder:
        close(enc_loc.grad, local(enc_ref.grad), f"{name}: encoder_output grad")
    for n, p in ref.named_parameters():
        mine = params[n]
        got = full_tensor(n, mine, mine.grad, tp, gated)
        if p.grad.abs().max() < 1e-6:  # the key bias without RoPE: softmax does not see it (rounding, both sides)
            assert got.abs().max() < 1e-5, f"{name}: {n} grad"
            continue
        close(got, p.grad, f"{name}: {n} grad")
    if before is not None:
        for comm, old in before.items():
            new = tec.get_ub(comm).stats()
            assert new != old, f"{name}: the {comm} communicator did not run"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    rank, tp, dev = setup(args.device)
    init_ub((S * B * tp, H), tp, dtype=torch.float32)
    failures = 0
    for name, kw in CASES.items():
        try:
            run_case(name, kw, rank, tp, dev)
            if rank == 0:
                print(f"ok {name}", flush=True)
        except Exception as e:  # report every case, then fail
            failures += 1
            print(f"rank {rank} FAIL {name}: {type(e).__name__}: {e}", flush=True)
    tec.destroy_ub()
    dist.barrier()
    if failures == 0 and rank == 0:
        print(f"PASS run_transformer_layer_tp (tp={tp}, {len(CASES)} cases)", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
