"""Benchmark: a GPT-style pre-LN block under torch.compile, CUDA graphs and
eagerly, ours against the same block of torch.nn modules.

    python -m transformer_engine_c.bench --compile [--out bench_compile]
    python -m transformer_engine_c.bench --compile --device cpu --shapes 64x64 --iters 3

Shapes are TOKENSxHIDDEN: TOKENS = sequence x batch (sequences of at most
2048 tokens), heads of 128 (of HIDDEN / 2 on shapes below 256), ffn 4 x
HIDDEN. The block: LayerNormLinear qkv, causal scaled-dot-product attention
(tec.DotProductAttention; torch: F.scaled_dot_product_attention), Linear
proj, residual, LayerNormMLP (tanh-GELU), residual. Each variant is timed
forward+backward with grad_output given:
  torch, torch_compiled, torch_reduce_overhead: the torch.nn block eager,
    under torch.compile, and under torch.compile(mode="reduce-overhead");
  ours, ours_compiled, ours_reduce_overhead, ours_graphed: ours eager, under
    torch.compile (fullgraph), under reduce-overhead, and captured with
    tec.make_graphed_callables;
  ours_fp8, ours_fp8_compiled, ours_fp8_graphed: ours under FP8
    DelayedScaling (the autocast entered per step around the forward), eager,
    compiled and graphed;
  torchao_fp8_compiled: the torch.nn block's Linears converted by torchao's
    float8 (tensorwise), compiled, where torchao is installed.
Reduce-overhead and graphs run on CUDA only. Sampling is --tp1's: interleaved
rounds, CUDA events (the host clock on the CPU), the median of --iters
samples of --batch steps. "compile s" is the first call's wall time (the
compile, for the compiled variants). A variant that cannot run keeps its
reason as its status. ratio = the other's ms / ours'. Results: a table on
stdout, compile.json and compile.md in --out. On the CPU the numbers only
show that every path runs.
"""
import argparse
import json
import sys
import time

import torch

from . import fp8, tp1
from .blocks import OurBlock, TorchBlock, copy_into, geometry, step, twin

GPU_SHAPES = [(1024, 1024), (2048, 2048), (8192, 4096)]
CPU_SHAPES = [(64, 64)]
VARIANTS = ("torch", "torch_compiled", "torch_reduce_overhead", "ours", "ours_compiled", "ours_reduce_overhead",
            "ours_graphed", "ours_fp8", "ours_fp8_compiled", "ours_fp8_graphed", "torchao_fp8_compiled")
CUDA_ONLY = ("torch_reduce_overhead", "ours_reduce_overhead", "ours_graphed", "ours_fp8_graphed")
RATIOS = {  # name: (numerator variant, denominator variant): ratio = ms[num] / ms[den]
    "compiled_vs_ours_eager": ("ours", "ours_compiled"),
    "compiled_vs_torch_compiled": ("torch_compiled", "ours_compiled"),
    "reduce_overhead_vs_torch_reduce_overhead": ("torch_reduce_overhead", "ours_reduce_overhead"),
    "graphed_vs_torch_reduce_overhead": ("torch_reduce_overhead", "ours_graphed"),
    "fp8_compiled_vs_compiled": ("ours_compiled", "ours_fp8_compiled"),
    "fp8_eager_vs_eager": ("ours", "ours_fp8"),
    "fp8_compiled_vs_torchao": ("torchao_fp8_compiled", "ours_fp8_compiled"),
    "eager_vs_torch_eager": ("torch", "ours"),
}


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c.bench --compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="comma-separated TOKENSxHIDDEN")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4, help="steps per timed sample")
    ap.add_argument("--out", default=None, help="directory for compile.json / compile.md")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if args.shapes:
        try:
            args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        except ValueError:
            ap.error(f"--shapes must be TOKENSxHIDDEN[,...], got {args.shapes!r}")
        if any(len(s) != 2 or min(s) <= 0 for s in args.shapes):
            ap.error(f"--shapes must be two positive ints each, got {args.shapes}")
    else:
        args.shapes = GPU_SHAPES if cuda else CPU_SHAPES
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; expected some of {VARIANTS}")
    return tp1.sampling_defaults(ap, args, cuda, cpu_iters=3)


def build(tec, recipe_mod, names, shape, args, device):
    """({variant: step callable}, {variant: status}) of one shape."""
    tokens, hidden = shape
    seq, batch, heads = geometry(tokens, hidden)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    ours = OurBlock(tec, hidden, heads, args.dtype, device)
    ref = TorchBlock(hidden, heads, args.dtype, device)
    copy_into(ours, ref)
    x = torch.randn(seq, batch, hidden, dtype=args.dtype, device=device, requires_grad=True)
    dy = torch.randn(seq, batch, hidden, dtype=args.dtype, device=device)
    delayed = recipe_mod.DelayedScaling()
    fns, status = {}, {}
    for name in names:
        if name in CUDA_ONLY and not cuda:
            status[name] = "skipped: CUDA only"
            continue
        try:
            if name == "torch":
                fns[name] = step(ref, x, dy)
            elif name == "torch_compiled":
                fns[name] = step(torch.compile(ref), x, dy)
            elif name == "torch_reduce_overhead":
                fns[name] = step(torch.compile(ref, mode="reduce-overhead"), x, dy)
            elif name == "ours":
                fns[name] = step(ours, x, dy)
            elif name == "ours_compiled":
                fns[name] = step(torch.compile(ours, fullgraph=True), x, dy)
            elif name == "ours_reduce_overhead":
                fns[name] = step(torch.compile(twin(tec, ours, hidden, heads, args.dtype, device),
                                               mode="reduce-overhead", fullgraph=True), x, dy)
            elif name == "ours_graphed":
                g = tec.make_graphed_callables(twin(tec, ours, hidden, heads, args.dtype, device), (x,))
                fns[name] = step(g, x, dy)
            elif name == "ours_fp8":
                fns[name] = step(twin(tec, ours, hidden, heads, args.dtype, device), x, dy, tec, delayed)
            elif name == "ours_fp8_compiled":
                m = torch.compile(twin(tec, ours, hidden, heads, args.dtype, device), fullgraph=True)
                fns[name] = step(m, x, dy, tec, recipe_mod.DelayedScaling())
            elif name == "ours_fp8_graphed":
                r = recipe_mod.DelayedScaling()
                g = tec.make_graphed_callables(twin(tec, ours, hidden, heads, args.dtype, device), (x,),
                                               fp8_enabled=True, fp8_recipe=r)
                fns[name] = step(g, x, dy, tec, r)
            elif name == "torchao_fp8_compiled":
                ao = fp8.load_torchao()
                if ao is None:
                    status[name] = fp8.NO_TORCHAO
                    continue
                fns[name] = step(fp8.torchao_block(ao, ref, True), x, dy)
        except Exception as exc:  # the row says why; the other variants still run
            status[name] = fp8.why(exc)
    return fns, status


def first_calls(fns, status, cuda):
    """Run each variant once (the compile), timing it; a failure becomes its status."""
    seconds, ran = {}, {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        try:
            fn()
            fn()  # reduce-overhead records its graphs on a later call
            if cuda:
                torch.cuda.synchronize()
        except Exception as exc:
            status[name] = fp8.why(exc)
            continue
        seconds[name] = time.perf_counter() - t0
        status[name] = fp8.OK
        ran[name] = fn
    return ran, seconds


def run(args):
    import transformer_engine_c as tec
    from transformer_engine_c import recipe as recipe_mod

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    rows = []
    for shape in args.shapes:
        fns, status = build(tec, recipe_mod, args.variants, shape, args, device)
        ran, seconds = first_calls(fns, status, cuda)
        res = tp1.compare(ran, args, cuda)
        ms = {n: v[0] for n, v in res.items()}
        host = {n: v[1] for n, v in res.items()}
        ratios = {r: (ms[a] / ms[b] if a in ms and b in ms and ms[b] > 0 else None) for r, (a, b) in RATIOS.items()}
        rows.append(dict(tokens=shape[0], hidden=shape[1], ms=ms, host_us=host, compile_s=seconds, status=status,
                         ratios=ratios, compile_adds=compile_adds(host)))
        del fns, ran
        torch._dynamo.reset()
    return rows


def compile_adds(host):
    """What torch.compile adds to each block's host µs per step: {"ours":
    ours_compiled - ours, "torch": torch_compiled - torch, "ratio": ours' /
    torch's (target <= 1.05)}, or None without the four variants (or where
    compiling takes nothing from torch's block, so that no ratio exists)."""
    if not all(n in host for n in ("ours", "ours_compiled", "torch", "torch_compiled")):
        return None
    ours, ref = host["ours_compiled"] - host["ours"], host["torch_compiled"] - host["torch"]
    return dict(ours=ours, torch=ref, ratio=ours / ref if ref > 0 else None)


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows):
    lines = []
    for r in rows:
        lines.append(f"block {r['tokens']}x{r['hidden']}")
        head = f"  {'variant':<24} {'ms':>9} {'host us':>9} {'compile s':>10}  status"
        lines += [head, "  " + "-" * (len(head) - 2)]
        for n in VARIANTS:
            if n in r["status"]:
                lines.append(f"  {n:<24} {_f(r['ms'].get(n), '9.4f')} {_f(r['host_us'].get(n), '9.1f')} "
                             f"{_f(r['compile_s'].get(n), '10.1f')}  {r['status'][n]}")
        for name, v in r["ratios"].items():
            if v is not None:
                lines.append(f"  ratio {name:<40} {v:.3f}")
        adds = r.get("compile_adds")
        if adds is not None:
            lines.append(f"  compiling adds host us: ours {adds['ours']:.1f}, torch {adds['torch']:.1f}, ratio "
                         f"{_f(adds['ratio'], '.3f')}")
    lines.append("ratio: the other variant's ms / ours (above 1: ours is faster); compiling adds: ours' added host "
                 "us / torch's (target <= 1.05)")
    return "\n".join(lines)


def markdown(rows, meta):
    out = ["# transformer_engine_c --compile benchmark", "", json.dumps(meta), "",
           "ms per forward+backward step (median); ratio = the other's ms / ours.", ""]
    names = [n for n in VARIANTS if any(n in r["status"] for r in rows)]
    out += ["| tokens × hidden | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        cells = [(_f(r["ms"].get(n), ".3f") if r["status"].get(n) == fp8.OK else "—") for n in names]
        out.append(f"| {r['tokens']} × {r['hidden']} | " + " | ".join(cells) + " |")
    out += ["", "| tokens × hidden | " + " | ".join(RATIOS) + " |", "|---|" + "---|" * len(RATIOS)]
    for r in rows:
        out.append(f"| {r['tokens']} × {r['hidden']} | " + " | ".join(_f(r["ratios"][k], ".3f") for k in RATIOS)
                   + " |")
    adds = [r for r in rows if r.get("compile_adds")]
    if adds:
        out += ["", "What torch.compile adds to each block's host µs per step (compiled − eager); ratio = ours / "
                "torch's (≤ 1.05).", "", "| tokens × hidden | ours | torch | ratio |", "|---|---|---|---|"]
        out += [f"| {r['tokens']} × {r['hidden']} | {r['compile_adds']['ours']:.1f} | "
                f"{r['compile_adds']['torch']:.1f} | {_f(r['compile_adds']['ratio'], '.3f')} |" for r in adds]
    out += ["", "Compile seconds (first two calls): " + "; ".join(
        f"{r['tokens']}×{r['hidden']}: " + ", ".join(f"{n} {s:.1f}" for n, s in r["compile_s"].items())
        for r in rows)]
    fails = [(r, n, s) for r in rows for n, s in r["status"].items() if s != fp8.OK]
    if fails:
        out += ["", "Did not run:"] + [f"- {r['tokens']}×{r['hidden']} {n}: {s}" for r, n, s in fails]
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    rows = run(args)
    print(table(rows))
    if args.out:
        meta = tp1.meta_of(args)
        tp1.write(args.out, "compile", dict(meta=meta, rows=rows), markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
