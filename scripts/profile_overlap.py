"""Where the time of an overlapped layer goes (a diagnostic, not a test).

Run under torchrun on the GPU machine:
    torchrun --nproc_per_node=2 scripts/profile_overlap.py --out DIR
For each shape and layer it prints three times per call: `host` (the CPU
time to issue one call, back-to-back calls, no sync), `gpu` (CUDA events
around 20 back-to-back calls, divided by 20: what the GPU needs when the
host is ahead) and `synced` (events around one call from an idle GPU,
as the benchmark times it). On rank 0 it also writes a cProfile of the
MLP step, torch.profiler chrome traces of the MLP step (mlp_MODE_SHAPE.json)
and of back-to-back overlapped layer calls (layer_fc1/fc2_SHAPE_rRANK.json, every rank) for
scripts/trace_summary.py.
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank


def times(fn, n=20, reps=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, gpu, synced = [], [], []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        for _ in range(n):
            fn()
        e.record()
        host.append((time.perf_counter() - t0) * 1e3 / n)
        e.synchronize()
        gpu.append(s.elapsed_time(e) / n)
        for _ in range(3):
            s.record()
            fn()
            e.record()
            e.synchronize()
            synced.append(s.elapsed_time(e))
    return statistics.median(host), statistics.median(gpu), statistics.median(synced)


MODES = ("none", "rs_dgrad", "bulk")  # fc1's backward: no overlap, dgrad GEMM+RS, bulk AG + bulk RS


def layers(T, H, N, size, group, overlap, dtype, device):
    ub1 = ub2 = {}
    if overlap != "none":
        tec.destroy_ub()
        tec.initialize_ub([T, max(H, N // size)], size, dtype=dtype, tp_group=group)
        bulk = overlap == "bulk"
        ub1 = dict(ub_overlap_ag=True, ub_overlap_rs_dgrad=not bulk, ub_bulk_dgrad=bulk, ub_bulk_wgrad=bulk,
                   ub_name="fc1")
        ub2 = dict(ub_overlap_rs=True, ub_overlap_ag=True, ub_name="fc2")
    kw = dict(params_dtype=dtype, device=device, sequence_parallel=True, tp_group=group)
    fc1 = tec.LayerNormLinear(H, N, parallel_mode="column", **kw, **ub1)
    fc2 = tec.Linear(N, H, parallel_mode="row", **kw, **ub2)
    return fc1, fc2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/profile")
    ap.add_argument("--shapes", default="2048x2048x6144,8192x4096x12288")
    args = ap.parse_args()
    rank, size, device = init_rank("cuda")
    group = dist.new_group(list(range(size)))
    dtype = torch.bfloat16
    os.makedirs(args.out, exist_ok=True)

    def say(line):  # incrementally, so a run cut short still reports
        if rank == 0:
            print(line, flush=True)
            with open(os.path.join(args.out, "times.txt"), "a") as f:
                f.write(line + "\n")
    for shape in args.shapes.split(","):
        T, H, N = (int(v) for v in shape.split("x"))
        x = torch.randn(T // size, H, dtype=dtype, device=device)
        xh = torch.randn(T, N // size, dtype=dtype, device=device)
        dy = torch.randn(T // size, H, dtype=dtype, device=device)
        xg = x.clone().requires_grad_()
        for overlap in MODES:
            fc1, fc2 = layers(T, H, N, size, group, overlap, dtype, device)

            def step():
                fc2(F.gelu(fc1(xg))).backward(dy)
            with torch.no_grad():
                cases = {"fc1 fwd": lambda: fc1(x), "fc2 fwd": lambda: fc2(xh)}
                res = {k: times(f) for k, f in cases.items()}
            res["mlp step"] = times(step, n=5)
            for k, (h, g, s) in res.items():
                say(f"{shape} overlap={overlap:8s} {k:9s} host {h:7.3f}  gpu {g:7.3f}  synced {s:7.3f} ms")
            first = shape == args.shapes.split(",")[0]
            if first:  # every rank steps (collectives): a trace of the MLP step alone
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                if rank == 0:
                    prof.export_chrome_trace(os.path.join(args.out, f"mlp_{overlap}_{shape}.json"))
            if overlap == "rs_dgrad" and first:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(20):
                    step()
                pr.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
                if rank == 0:
                    with open(os.path.join(args.out, f"cprofile_{shape}.txt"), "w") as f:
                        f.write(buf.getvalue())
            if overlap == "rs_dgrad" and first:  # traces of back-to-back overlapped layer calls
                for name, fn in cases.items():
                    with torch.no_grad():
                        fn()
                        torch.cuda.synchronize()
                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            for _ in range(5):
                                fn()
                            torch.cuda.synchronize()
                    prof.export_chrome_trace(os.path.join(args.out, f"layer_{name.split()[0]}_{shape}_r{rank}.json"))
            dist.barrier()
    # norm kernels against torch and a copy
    for rows, cols in ((4096, 4096), (8192, 4096), (8192, 8192), (16384, 8192), (4096, 2048)):
        x = torch.randn(rows, cols, dtype=dtype, device=device)
        g, b = torch.randn(cols, dtype=dtype, device=device), torch.randn(cols, dtype=dtype, device=device)
        dst = torch.empty_like(x)
        nb = 2 * x.numel() * x.element_size()
        for name, fn in (("copy", lambda: dst.copy_(x)), ("torch LN", lambda: F.layer_norm(x, (cols,), g, b)),
                         ("tec LN", lambda: tec._engine.norm_fwd(x, g, b, 1e-5)),
                         ("tec RMS", lambda: tec._engine.norm_fwd(x, g, None, 1e-5))):
            h, gt, s = times(fn, n=50)
            say(f"norm {rows}x{cols} {name:8s} host {h * 1e3:6.1f} us gpu {gt * 1e3:8.1f} us  "
                          f"{nb / gt / 1e6:7.0f} GB/s")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                dst.copy_(x)
                tec._engine.norm_fwd(x, g, b, 1e-5)
                tec._engine.norm_fwd(x, g, None, 1e-5)
                F.layer_norm(x, (cols,), g, b)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.count >= 20:
                us = ev.device_time_total / ev.count
                say(f"  kernel {rows}x{cols} {ev.key[:60]:60s} {us:8.1f} us {nb / us / 1e3:7.0f} GB/s")
    tec.destroy_ub()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
