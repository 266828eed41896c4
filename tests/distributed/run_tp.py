"""torchrun runner: tensor-parallel Linear (column, row) and LayerNormLinear
(column), with and without sequence parallelism, fp32 and bf16, against a
single-process float64 reference of the full layer: output, input grad and
every parameter grad (shards gathered). Prints "PASS run_tp" on success.

    torchrun --nproc_per_node=2 tests/distributed/run_tp.py [--device cuda]
"""
import argparse
import itertools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c._launch import init_rank  # noqa: E402
from common import rel_err  # noqa: E402
from reference import layernorm_linear  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def chunk(t, dim, rank, size):
    return t.chunk(size, dim)[rank].contiguous()


def check_case(kind, mode, sp, dtype, device, rank, size, group):
    S, B, IN, OUT = 8, 2, 32, 24
    gen = torch.Generator().manual_seed(1234)
    full = {"weight": torch.randn(OUT, IN, generator=gen) * 0.3, "bias": torch.randn(OUT, generator=gen)}
    if kind == "LayerNormLinear":
        full["layer_norm_weight"] = 1 + 0.2 * torch.randn(IN, generator=gen)
        full["layer_norm_bias"] = torch.randn(IN, generator=gen) * 0.2
    x_full = torch.randn(S, B, IN, generator=gen)
    dy_full = torch.randn(S, B, OUT, generator=gen)

    # Reference on the full problem, float64.
    ref = {k: v.double().requires_grad_() for k, v in full.items()}
    xr = x_full.double().requires_grad_()
    if kind == "LayerNormLinear":
        yr, _ = layernorm_linear(xr, ref["layer_norm_weight"], ref["layer_norm_bias"], ref["weight"], ref["bias"])
    else:
        yr = torch.nn.functional.linear(xr, ref["weight"], ref["bias"])
    yr.backward(dy_full.double())

    cls = tec.LayerNormLinear if kind == "LayerNormLinear" else tec.Linear
    m = cls(IN, OUT, params_dtype=dtype, device=device, parallel_mode=mode, sequence_parallel=sp,
            tp_group=group, tp_size=size)
    # How each tensor is split on this rank: dim or None (replicated).
    wdim = 0 if mode == "column" else 1
    split = {"weight": wdim, "bias": 0 if mode == "column" else None,
             "layer_norm_weight": None, "layer_norm_bias": None}
    x_dim = 0 if (sp and mode == "column") else (2 if mode == "row" else None)
    y_dim = 2 if mode == "column" else (0 if sp else None)
    with torch.no_grad():
        for name, p in m.named_parameters():
            v = full[name] if split[name] is None else chunk(full[name], split[name], rank, size)
            p.copy_(v.to(dtype))
    local = lambda t, d: t if d is None else chunk(t, d, rank, size)  # noqa: E731
    x = local(x_full, x_dim).to(dtype).to(device).requires_grad_()
    y = m(x)
    y.backward(local(dy_full, y_dim).to(dtype).to(device))
    # As with TE (and Megatron), gradients of parameters marked
    # sequence_parallel are partial sums the training loop reduces.
    marked = {n for n, p in m.named_parameters() if getattr(p, "sequence_parallel", False)}
    want = {"layer_norm_weight", "layer_norm_bias"} & set(full) if sp else set()
    if sp and mode == "row":
        want.add("bias")
    assert marked == want, (kind, mode, sp, marked)
    tec.allreduce_sequence_parallel_grads(m)

    tol = TOL[dtype]
    errs = {"output": rel_err(y, local(yr, y_dim)), "input grad": rel_err(x.grad, local(xr.grad, x_dim))}
    for name, p in m.named_parameters():
        errs[name + " grad"] = rel_err(p.grad, local(ref[name].grad, split[name]))
    bad = {k: v for k, v in errs.items() if not v < tol}
    label = f"{kind} mode={mode} sp={sp} {str(dtype)[6:]}"
    if bad:
        raise AssertionError(f"rank {rank}: {label}: errors over {tol}: {bad}")
    return label


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    rank, size, device = init_rank(args.device)
    group = dist.new_group(list(range(size)))
    cases = [("Linear", "column"), ("Linear", "row"), ("LayerNormLinear", "column")]
    n = 0
    for (kind, mode), sp, dtype in itertools.product(cases, [False, True], [torch.float32, torch.bfloat16]):
        label = check_case(kind, mode, sp, dtype, device, rank, size, group)
        n += 1
        if rank == 0:
            print(f"ok {label}", flush=True)
    # Bad input under TP: a sequence that cannot be reduce-scattered.
    m = tec.Linear(16, 8, device=device, parallel_mode="row", sequence_parallel=True, tp_group=group)
    try:
        m(torch.randn(size + 1, 2, 16 // size, device=device))
    except ValueError as e:
        assert "not divisible by the tensor-parallel size" in str(e), e
    else:
        raise AssertionError("a sequence length not divisible by the TP size was accepted")
    dist.barrier()
    if rank == 0:
        print(f"PASS run_tp ({n} cases, tp={size}, {device.type})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
