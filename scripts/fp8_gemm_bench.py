"""FP8 on one CUDA GPU: the engine's quantize against torch's float8 cast,
its FP8 GEMM against torch._scaled_mm and a float64 reference (--check),
and the GEMM benchmark: our FP8 GEMM (fast and split accumulation) against
torch._scaled_mm, our bf16 GEMM and torch's bf16 matmul (--bench), plus the
quantize kernels' bandwidth. Shapes are tokens x in x out (m x k x n).

    python3 scripts/fp8_gemm_bench.py --check --bench
Prints one "CHECK PASS"/"CHECK FAIL" line per check and a table."""
import argparse
import sys

import torch

from transformer_engine_c import _engine, _fp8_engine as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(8192, 4096, 12288), (4096, 4096, 16384), (2048, 2048, 6144)]


def torch_cast(x, fp8_dtype, scale):
    m = F.FP8_MAX[fp8_dtype]
    return (x.float() * scale).clamp(-m, m).to(fp8_dtype)


def quantize_pair(shape, fp8_dtype, gen):
    x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    amax = F.amax(x)
    scale, scale_inv = F.scale_from_amax(amax, fp8_dtype)
    data, _, si = F.quantize(x, fp8_dtype, scale)
    return x, data, si, scale


def timed(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check():
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)

    def report(name, cond, detail):
        nonlocal ok
        ok &= bool(cond)
        print(f"CHECK {'PASS' if cond else 'FAIL'} {name}: {detail}", flush=True)

    for fp8_dtype in (E4M3, E5M2):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x = (torch.randn(1000, 1024, device="cuda", generator=gen) * 100).to(dtype)
            x[0, :4] = torch.tensor([float("inf"), -float("inf"), 1e30, 0.0])
            scale = torch.tensor([0.75], device="cuda")
            data, data_t, _ = F.quantize(x, fp8_dtype, scale, columnwise=True)
            want = torch_cast(x, fp8_dtype, 0.75).view(torch.uint8)
            bad = int((data != want).sum()) + int((data_t != want.t()).sum())
            report(f"quantize {dtype}->{fp8_dtype}", bad == 0, f"{bad} bytes differ from torch's cast")
    for m, k, n in [(256, 512, 384), (1024, 4096, 2048)]:
        for fa, fb in ((E4M3, E4M3), (E5M2, E4M3)):
            _, a, sa, _ = quantize_pair((m, k), fa, gen)
            _, b, sb, _ = quantize_pair((n, k), fb, gen)
            ref = (a.view(fa).double() * sa.double()) @ (b.view(fb).double() * sb.double()).t()
            for fast in (True, False):
                ours = F.fp8_gemm(a, sa, fa, b, sb, fb, out_dtype=torch.bfloat16, use_split_accumulator=not fast)
                theirs = torch._scaled_mm(a.view(fa), b.view(fb).t(), scale_a=sa, scale_b=sb,
                                          out_dtype=torch.bfloat16, use_fast_accum=fast)
                e_ref = ((ours.double() - ref).norm() / ref.norm()).item()
                e_torch = ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()
                report(f"fp8 gemm {m}x{k}x{n} {fa}x{fb} fast={fast}", e_ref < 8e-3 and e_torch < 8e-3,
                       f"rel err vs float64 {e_ref:.2e}, vs torch._scaled_mm {e_torch:.2e}")
            out32 = F.fp8_gemm(a, sa, fa, b, sb, fb, out_dtype=torch.float32)
            e32 = ((out32.double() - ref).norm() / ref.norm()).item()
            report(f"fp8 gemm fp32 out {m}x{k}x{n}", e32 < 3e-4, f"rel err vs float64 {e32:.2e}")
    return ok


def bench():
    gen = torch.Generator(device="cuda").manual_seed(1)
    print(f"{'m x k x n':>20} {'ours fp8 fast':>14} {'ours fp8 split':>15} {'_scaled_mm':>11} {'ours bf16':>10} "
          f"{'torch bf16':>11} {'fp8/bf16':>9} {'fp8/_scaled_mm':>15}   (TFLOP/s)")
    for m, k, n in SHAPES:
        x, a, sa, _ = quantize_pair((m, k), E4M3, gen)
        w, b, sb, _ = quantize_pair((n, k), E4M3, gen)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        flops = 2.0 * m * n * k
        t_fast = timed(lambda: F.fp8_gemm(a, sa, E4M3, b, sb, E4M3, out=out, use_split_accumulator=False))
        t_split = timed(lambda: F.fp8_gemm(a, sa, E4M3, b, sb, E4M3, out=out, use_split_accumulator=True))
        a8, bt8 = a.view(E4M3), b.view(E4M3).t()
        t_smm = timed(lambda: torch._scaled_mm(a8, bt8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                               use_fast_accum=True))
        t_bf16 = timed(lambda: _engine.gemm(x, w, transb=True))
        t_torch = timed(lambda: x @ w.t())
        tf = [flops / t / 1e9 for t in (t_fast, t_split, t_smm, t_bf16, t_torch)]
        print(f"{f'{m}x{k}x{n}':>20} {tf[0]:14.0f} {tf[1]:15.0f} {tf[2]:11.0f} {tf[3]:10.0f} {tf[4]:11.0f} "
              f"{t_bf16 / t_fast:8.2f}x {t_smm / t_fast:14.3f}x", flush=True)
    print(f"\n{'quantize bf16 [rows, cols]':>28} {'rowwise GB/s':>13} {'+transpose GB/s':>16} {'torch cast GB/s':>16}")
    for rows, cols in ((8192, 4096), (8192, 12288), (2048, 2048)):
        x = torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16)
        s = torch.ones(1, device="cuda")
        amax = torch.zeros(1, device="cuda")
        nbytes = rows * cols * 3  # 2 read + 1 written
        t_row = timed(lambda: F.quantize(x, E4M3, s, amax=amax))
        t_tr = timed(lambda: F.quantize(x, E4M3, s, amax=amax, columnwise=True))
        t_torch = timed(lambda: torch_cast(x, E4M3, s))
        print(f"{f'[{rows}, {cols}]':>28} {nbytes / t_row / 1e6:13.0f} {(nbytes + rows * cols) / t_tr / 1e6:16.0f} "
              f"{nbytes / t_torch / 1e6:16.0f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    args = p.parse_args()
    ok = True
    if args.check:
        ok = check()
    if args.bench:
        bench()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
