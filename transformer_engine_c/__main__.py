"""The main job: a tensor-parallel block (LayerNormLinear column -> GELU ->
Linear row, sequence parallel) forward and backward on N ranks, with and
without userbuffers comm-GEMM overlap, each checked against a single-process
float64 reference, with a short report (errors, time per step, which
overlapped paths ran).

    python -m transformer_engine_c                 # 2 CPU ranks, or every GPU
    python -m transformer_engine_c --nproc 4 --device cpu --steps 5
It launches its own ranks (through torch.distributed.run) unless it already
runs under torchrun.
"""
import argparse
import sys
import time

import torch

from ._launch import init_rank, relaunch, under_torchrun


def parse():
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpus else "cpu")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: 2 on CPU, every GPU)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (all ranks)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None, help="FFN width (default 4*hidden)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: 5 on CPU, 20 on GPUs)")
    ap.add_argument("--overlap", choices=["both", "on", "off"], default="both",
                    help="userbuffers comm-GEMM overlap: run the block with it, without it, or both")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not gpus:
        ap.error("--device cuda but no CUDA GPU is visible")
    args.nproc = args.nproc or (gpus if cuda else 2)
    args.seq = args.seq or (4096 if cuda else 64)
    args.hidden = args.hidden or (2048 if cuda else 128)
    args.ffn = args.ffn or 4 * args.hidden
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.steps = (20 if cuda else 5) if args.steps is None else args.steps
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    return args


def worker(args):
    import torch.distributed as dist
    import torch.nn.functional as F

    import transformer_engine_c as tec

    rank, size, device = init_rank(args.device)
    dtype = getattr(torch, args.dtype)
    S, B, H, F_ = args.seq, args.batch, args.hidden, args.ffn
    if S % size or F_ % size:
        raise SystemExit(f"--seq {S} and --ffn {F_} must be divisible by {size} ranks")
    group = dist.new_group(list(range(size)))
    gen = torch.Generator().manual_seed(0)
    full = {"g": 1 + 0.1 * torch.randn(H, generator=gen), "b": 0.1 * torch.randn(H, generator=gen),
            "w1": torch.randn(F_, H, generator=gen) / H ** 0.5, "b1": 0.1 * torch.randn(F_, generator=gen),
            "w2": torch.randn(H, F_, generator=gen) / F_ ** 0.5, "b2": 0.1 * torch.randn(H, generator=gen)}
    x_full = torch.randn(S, B, H, generator=gen)
    dy_full = torch.randn(S, B, H, generator=gen)

    # Reference: the whole block in float64 in one process.
    r = {k: v.double().requires_grad_() for k, v in full.items()}
    xr = x_full.double().requires_grad_()
    yr = F.linear(F.gelu(F.linear(F.layer_norm(xr, (H,), r["g"], r["b"], 1e-5), r["w1"], r["b1"])), r["w2"], r["b2"])
    yr.backward(dy_full.double())

    def err(a, b):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        return ((a - b).abs().max() / b.abs().max()).item()

    def run(overlap):
        """Build the block (with or without userbuffers overlap), check one
        step against the reference, time args.steps more."""
        ub1 = ub2 = {}
        if overlap:
            # The job shows the overlapped paths at work, so it takes them at
            # every size (no small-shape fallback; see initialize_ub).
            tec.initialize_ub([S * B, H], size, dtype=dtype, tp_group=group, device=device, min_chunk_flops=0)
            ub1 = dict(ub_overlap_ag=True, ub_overlap_rs_dgrad=True, ub_name="fc1")
            ub2 = dict(ub_overlap_rs=True, ub_overlap_ag=True, ub_name="fc2")
        fc1 = tec.LayerNormLinear(H, F_, params_dtype=dtype, device=device, parallel_mode="column",
                                  sequence_parallel=True, tp_group=group, **ub1)
        fc2 = tec.Linear(F_, H, params_dtype=dtype, device=device, parallel_mode="row",
                         sequence_parallel=True, tp_group=group, **ub2)
        with torch.no_grad():
            fc1.layer_norm_weight.copy_(full["g"]); fc1.layer_norm_bias.copy_(full["b"])
            fc1.weight.copy_(full["w1"].chunk(size, 0)[rank]); fc1.bias.copy_(full["b1"].chunk(size, 0)[rank])
            fc2.weight.copy_(full["w2"].chunk(size, 1)[rank]); fc2.bias.copy_(full["b2"])
        x = x_full.chunk(size, 0)[rank].to(dtype).to(device).requires_grad_()
        dy = dy_full.chunk(size, 0)[rank].to(dtype).to(device)

        def step():
            x.grad = None
            for p in (*fc1.parameters(), *fc2.parameters()):
                p.grad = None
            y = fc2(F.gelu(fc1(x)))
            y.backward(dy)
            tec.allreduce_sequence_parallel_grads(fc1, fc2)  # the norm's and row bias's partial sums (SP)
            return y

        y = step()
        errs = torch.tensor([err(y, yr.chunk(size, 0)[rank]), err(x.grad, xr.grad.chunk(size, 0)[rank]),
                             err(fc1.weight.grad, r["w1"].grad.chunk(size, 0)[rank]),
                             err(fc2.weight.grad, r["w2"].grad.chunk(size, 1)[rank]),
                             err(fc1.layer_norm_weight.grad, r["g"].grad)], dtype=torch.float64)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        counts = {}
        if overlap:
            for name in ("fc1_fprop", "fc1_dgrad", "fc2_fprop", "fc2_dgrad"):
                for k, v in tec.get_ub(name).stats().items():
                    counts[k] = counts.get(k, 0) + v
            tec.destroy_ub()
        errs_all = [None] * size
        dist.all_gather_object(errs_all, errs)
        return torch.stack(errs_all).max(0).values, ms, counts

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    results = {mode: run(mode == "on") for mode in (["off", "on"] if args.overlap == "both" else [args.overlap])}
    ok = all(bool((w < tol).all()) for w, _, _ in results.values())
    if "on" in results:  # every overlapped path ran, once per step and layer
        c = results["on"][2]
        ok = ok and c.get("ag_overlap", 0) >= 2 * (args.steps + 1) and c.get("rs_overlap", 0) >= 2 * (args.steps + 1)
    if rank == 0:
        print(f"transformer_engine_c main job: {size} ranks on {device.type}, {args.dtype}")
        print(f"  block: LayerNormLinear({H}->{F_}, column, SP) -> GELU -> Linear({F_}->{H}, row, SP)")
        print(f"  input [seq={S}, batch={B}, hidden={H}], {S // size} sequence rows per rank")
        names = ["output", "input grad", "fc1 weight grad", "fc2 weight grad", "layer_norm_weight grad"]
        for mode, (worst, ms, counts) in results.items():
            print(f"  overlap {mode}:")
            for n, e in zip(names, worst.tolist()):
                print(f"    max |error| / max |ref|  {n:<24} {e:.2e}")
            print(f"    time per forward+backward step: {ms:.3f} ms (mean of {args.steps})")
            if counts:
                print("    overlapped paths run: " + ", ".join(f"{k}={counts[k]}" for k in
                                                           ("ag_overlap", "rs_overlap", "bulk_ag", "bulk_rs")))
        if len(results) == 2:
            print(f"  overlap on vs off: {results['off'][1] / results['on'][1]:.2f}x "
                  "(a demonstration; python -m transformer_engine_c.bench measures speed)")
        print(f"  {'PASS' if ok else 'FAIL'} (tolerance {tol:g})")
    dist.destroy_process_group()
    return 0 if ok else 1


def main():
    args = parse()
    if not under_torchrun():
        return relaunch("transformer_engine_c", args.nproc)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
