"""Block-scaled FP8 on one CUDA GPU (Hopper): our block GEMM against
torch's blockwise scaled_mm (1x128 x 128x128 and 1x128 x 1x128, when this
torch offers them) and against dequantize-then-matmul in float64 (--check),
and the block GEMM's speed against the per-tensor FP8 GEMM and bf16 at
8192x4096x12288 (m x k x n), plus the block quantize's bandwidth (--bench).

    python3 scripts/fp8_block_bench.py --check --bench
Prints one "CHECK PASS"/"CHECK FAIL"/"CHECK SKIP" line per check and a table."""
import argparse
import sys

import torch

from transformer_engine_c import _engine, _fp8_engine as F
from fp8_gemm_bench import timed  # one CUDA-event timer for the FP8 benchmarks in scripts/

E4M3 = torch.float8_e4m3fn
B = F.BLOCK


def dequantize(data, sinv, block_dim):
    rows, cols = data.shape
    if block_dim == 2:
        s = sinv[:, :-(-cols // B)].double().repeat_interleave(B, 0).repeat_interleave(B, 1)[:rows, :cols]
    else:
        s = sinv[:, :rows].double().t().repeat_interleave(B, 1)[:, :cols]
    return data.view(E4M3).double() * s


def torch_blockwise(qa, sa, qb, sb, b_dim):
    """torch's scaled_mm with our scales viewed in its layout: A's 1x128
    scales [m, k/128] with stride (1, m); B (= our [n, k] operand
    transposed) 128x128 scales [round4(k/128), n/128] with stride (1, L4),
    or 1x128 scales [n, k/128] with stride (1, n). None if torch refuses."""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    st = getattr(torch.nn.functional, "ScalingType", None)
    if fn is None or st is None:
        return None, "torch.nn.functional.scaled_mm / ScalingType not in this torch"
    m, n = qa.shape[0], qb.shape[0]
    scale_a = sa[:, :m].t()
    scale_b = sb.t() if b_dim == 2 else sb[:, :n].t()
    recipe_b = st.BlockWise128x128 if b_dim == 2 else st.BlockWise1x128
    try:
        out = fn(qa.view(E4M3), qb.view(E4M3).t(), scale_a, st.BlockWise1x128, scale_b, recipe_b,
                 output_dtype=torch.bfloat16)
        return out, ""
    except Exception as e:  # noqa: BLE001 - any refusal is reported, not fatal
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def rel(a, b):
    b = b.double()
    return ((a.double() - b).norm() / b.norm()).item()


def check():
    ok = True

    def report(name, cond, detail, skip=False):
        nonlocal ok
        if not skip:
            ok &= bool(cond)
        print(f"CHECK {'SKIP' if skip else 'PASS' if cond else 'FAIL'} {name}: {detail}", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in ((256, 512, 384), (1024, 1024, 1024), (320, 256, 336)):
        a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        b = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
        for b_dim in (2, 1):
            qa, sa, _, _ = F.block_quantize(a, E4M3, 1)
            qb, sb, _, _ = F.block_quantize(b, E4M3, b_dim)
            ours = F.fp8_block_gemm(qa, sa, 1, E4M3, qb, sb, b_dim, E4M3, out_dtype=torch.float32)
            ref = dequantize(qa, sa, 1) @ dequantize(qb, sb, b_dim).t()
            e = rel(ours, ref)
            report(f"block gemm 1Dx{b_dim}D {m}x{k}x{n} vs float64", e < 5e-4, f"rel {e:.2e}")
            theirs, why = torch_blockwise(qa, sa, qb, sb, b_dim)
            if theirs is None:
                report(f"block gemm 1Dx{b_dim}D {m}x{k}x{n} vs torch scaled_mm", True, why, skip=True)
            else:
                e = rel(ours.bfloat16(), theirs)
                report(f"block gemm 1Dx{b_dim}D {m}x{k}x{n} vs torch scaled_mm", e < 8e-3, f"rel {e:.2e}")
    return ok


def bench():
    gen = torch.Generator(device="cuda").manual_seed(1)
    m, k, n = 8192, 4096, 12288
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    flops = 2.0 * m * n * k
    qa, sa, _, _ = F.block_quantize(x, E4M3, 1)
    qb, sb, _, _ = F.block_quantize(w, E4M3, 2)
    qb1, sb1, _, _ = F.block_quantize(w, E4M3, 1)
    ta, tsa = F.scale_from_amax(F.amax(x), E4M3)
    tb, tsb = F.scale_from_amax(F.amax(w), E4M3)
    pa, _, psa = F.quantize(x, E4M3, ta)
    pb, _, psb = F.quantize(w, E4M3, tb)
    rows = [
        ("block 1x128 x 128x128", lambda: F.fp8_block_gemm(qa, sa, 1, E4M3, qb, sb, 2, E4M3, out=out)),
        ("block 1x128 x 1x128", lambda: F.fp8_block_gemm(qa, sa, 1, E4M3, qb1, sb1, 1, E4M3, out=out)),
        ("per-tensor fp8 split", lambda: F.fp8_gemm(pa, psa, E4M3, pb, psb, E4M3, out=out)),
        ("per-tensor fp8 fast", lambda: F.fp8_gemm(pa, psa, E4M3, pb, psb, E4M3, out=out,
                                                   use_split_accumulator=False)),
        ("ours bf16", lambda: _engine.gemm(x, w, transb=True, out=out)),
        ("torch bf16", lambda: x @ w.t()),
    ]
    theirs, why = torch_blockwise(qa, sa, qb, sb, 2)
    if theirs is not None:
        rows.insert(2, ("torch scaled_mm 1x128 x 128x128", lambda: torch_blockwise(qa, sa, qb, sb, 2)))
    else:
        print(f"torch blockwise scaled_mm not timed: {why}")
    print(f"GEMM {m}x{k}x{n} (m x k x n), bf16 out")
    times = {}
    for name, fn in rows:
        t = timed(fn)
        times[name] = t
        print(f"  {name:>32}: {t:8.3f} ms {flops / t / 1e9:7.0f} TFLOP/s", flush=True)
    tb_ = times["block 1x128 x 128x128"]
    print(f"SUMMARY block GEMM {flops / tb_ / 1e9:.0f} TFLOP/s; time of per-tensor split / block "
          f"{times['per-tensor fp8 split'] / tb_:.2f}, of our bf16 / block {times['ours bf16'] / tb_:.2f}")
    print(f"\n{'block quantize bf16 [rows, cols]':>34} {'1x128+128x1 GB/s':>17} {'128x128 GB/s':>13}")
    for r, c in ((8192, 4096), (8192, 12288)):
        t = torch.randn(r, c, device="cuda", generator=gen).to(torch.bfloat16)
        t1 = timed(lambda: F.block_quantize(t, E4M3, 1, columnwise=True))
        t2 = timed(lambda: F.block_quantize(t, E4M3, 2))
        print(f"{f'[{r}, {c}]':>34} {r * c * 4 / t1 / 1e6:17.0f} {r * c * 3 / t2 / 1e6:13.0f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to run")
        return 1
    ok = check() if args.check else True
    if args.bench:
        bench()
    print("CHECKS PASS" if ok else "CHECKS FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
