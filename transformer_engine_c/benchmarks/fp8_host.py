"""Benchmark: the host's time per eager training step, bf16 against FP8,
per layer and for a GPT-style block, and where the FP8 step's host time goes.

    python -m transformer_engine_c.bench --fp8 --host [--out bench_fp8_host]
    python -m transformer_engine_c.bench --fp8 --host --device cpu --iters 3

Rows: LayerNormLinear, Linear and LayerNormMLP (TOKENSxHIDDENxN as in --tp1)
and the block of --compile (LayerNormLinear qkv, causal attention, Linear
proj, LayerNormMLP; TOKENSxHIDDEN), each a forward+backward step with
grad_output given, in bf16 ("bf16") and under FP8 DelayedScaling and
Float8CurrentScaling (the autocast entered around the forward per step, as
in training), and DelayedScaling with the one-call FP8 steps off
("fp8_delayed_general": each cast and GEMM its own engine call). Each variant is sampled as --tp1 samples (interleaved rounds,
the median of --iters samples of --batch steps): host µs is the host's time
to issue a step, device ms the device's time per step (CUDA events; the host
clock on the CPU). host ratio = FP8 host µs / bf16 host µs (the target is
<= 1.15); x = bf16 ms / FP8 ms.

Where the host time goes: one more run of --batch steps of each row's bf16
and FP8 DelayedScaling steps under cProfile, each function's own time put in
a category (CATEGORIES: engine calls, allocations, autograd's engine, the
FP8 bookkeeping, the layers' steps, ...) and scaled so that a step's
categories sum to its measured host µs (the profiler slows Python more than
C: the shares are indicative, the totals are the measurement's). On the CPU
the engine calls also compute (the CPU engine runs the kernels): there the
host time that is not the engine's is what compares with a GPU host's.
Results: tables on stdout, fp8_host.json and fp8_host.md in --out.
"""
import argparse
import cProfile
import pstats
import sys

import torch

from . import blocks
from . import fp8 as fp8_bench
from . import tp1

GPU_LAYER_SHAPES = [(2048, 2048, 6144), (1024, 1024, 4096)]
GPU_BLOCK_SHAPES = [(1024, 1024), (2048, 2048)]
CPU_LAYER_SHAPES = [(64, 64, 128)]
CPU_BLOCK_SHAPES = [(64, 64)]
LAYERS = ("LayerNormLinear", "Linear", "LayerNormMLP")
VARIANTS = ("bf16", "fp8_delayed", "fp8_current", "fp8_delayed_general")
# (category, test on (file, function name)), the first that matches
CATEGORIES = (
    ("engine calls", lambda f, n: f == "~" and n.startswith("<built-in method transformer_engine_c.")),
    ("allocations", lambda f, n: f == "~" and any(a in n for a in ("empty", "new_empty", "zeros", "expand",
                                                                    "ones", "full"))),
    ("autograd engine", lambda f, n: "run_backward" in n or "torch/autograd" in f),
    ("FP8 bookkeeping", lambda f, n: any(p in f for p in ("module/_fp8.py", "module/_fp8_gemm.py", "quantization.py",
                                                           "_fp8_meta.py", "_fp8_engine.py"))),
    ("layer steps", lambda f, n: "transformer_engine_c/module" in f),
    ("attention", lambda f, n: "attention" in f or "scaled_dot_product" in n),
    ("torch", lambda f, n: f == "~" or "/torch/" in f),
    ("other", lambda f, n: True),
)


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c.bench --fp8 --host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="comma-separated TOKENSxHIDDENxN for the layers (default: "
                    "2048x2048x6144,1024x1024x4096 on CUDA, 64x64x128 on the CPU)")
    ap.add_argument("--block-shapes", default=None, help="comma-separated TOKENSxHIDDEN for the block (default: "
                    "1024x1024,2048x2048 on CUDA, 64x64 on the CPU)")
    ap.add_argument("--layers", default=",".join(LAYERS + ("block",)),
                    help=f"comma-separated, of {', '.join(LAYERS)}, block")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="high-precision dtype (default bfloat16)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8, help="steps per timed sample")
    ap.add_argument("--out", default=None, help="directory for fp8_host.json / fp8_host.md")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    args.layers = [n for n in args.layers.split(",") if n]
    bad = [n for n in args.layers if n not in LAYERS + ("block",)]
    if bad:
        ap.error(f"unknown layer(s) {bad}; expected some of {LAYERS + ('block',)}")
    args.shapes = tp1.parse_shapes(ap, args.shapes) if args.shapes else (GPU_LAYER_SHAPES if cuda
                                                                         else CPU_LAYER_SHAPES)
    if args.block_shapes:
        args.block_shapes = [(t, h) for t, h, _ in tp1.parse_shapes(
            ap, ",".join(f"{s}x1" for s in args.block_shapes.split(",") if s))]
    else:
        args.block_shapes = GPU_BLOCK_SHAPES if cuda else CPU_BLOCK_SHAPES
    if args.dtype is None:
        args.dtype = "bfloat16"
    return tp1.sampling_defaults(ap, args, cuda, cpu_iters=3)


def layer_steps(tec, recipe_mod, layer, shape, dtype, device):
    """{variant: step} of one layer (one layer per variant, equal parameters)."""
    T, H, N = shape
    ours, _ = tp1.build(tec, layer, H, N, dtype, device)
    x = torch.randn(T, H, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(T, H if layer == "LayerNormMLP" else N, dtype=dtype, device=device)
    delayed = fp8_bench.fp8_twin(tec, layer, H, N, dtype, device, ours)
    current = fp8_bench.fp8_twin(tec, layer, H, N, dtype, device, ours)
    general = fp8_bench.fp8_twin(tec, layer, H, N, dtype, device, ours)
    return {"bf16": tp1.steps(ours, x, dy)["fwd+bwd"],
            "fp8_delayed": fp8_bench.fp8_step(tec, delayed, x, dy, recipe_mod.DelayedScaling()),
            "fp8_current": fp8_bench.fp8_step(tec, current, x, dy, recipe_mod.Float8CurrentScaling()),
            "fp8_delayed_general": general_path(fp8_bench.fp8_step(tec, general, x, dy, recipe_mod.DelayedScaling()))}


def general_path(step):
    """step with the FP8 one-call steps off (module/_fp8_gemm.ONE_CALL): each
    cast and GEMM its own engine call, as before they existed."""
    from transformer_engine_c.module import _fp8_gemm

    def run():
        _fp8_gemm.ONE_CALL = False
        try:
            step()
        finally:
            _fp8_gemm.ONE_CALL = True
    return run


def block_steps(tec, recipe_mod, shape, dtype, device):
    """{variant: step} of the GPT-style block of --compile."""
    tokens, hidden = shape
    seq, batch, heads = blocks.geometry(tokens, hidden)
    ours = blocks.OurBlock(tec, hidden, heads, dtype, device)
    x = torch.randn(seq, batch, hidden, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(seq, batch, hidden, dtype=dtype, device=device)
    delayed = blocks.twin(tec, ours, hidden, heads, dtype, device)
    current = blocks.twin(tec, ours, hidden, heads, dtype, device)
    general = blocks.twin(tec, ours, hidden, heads, dtype, device)
    return {"bf16": blocks.step(ours, x, dy),
            "fp8_delayed": blocks.step(delayed, x, dy, tec, recipe_mod.DelayedScaling()),
            "fp8_current": blocks.step(current, x, dy, tec, recipe_mod.Float8CurrentScaling()),
            "fp8_delayed_general": general_path(blocks.step(general, x, dy, tec, recipe_mod.DelayedScaling()))}


def category(key):
    """The category of a pstats key (file, line, function name)."""
    f, _, n = key
    f = f.replace("\\", "/")
    for name, test in CATEGORIES:
        if test(f, n):
            return name
    return "other"


def breakdown(fn, batch, host_us, cuda):
    """{category: host µs per step} of `batch` steps of fn under cProfile,
    scaled to sum to host_us."""
    if cuda:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(batch):
        fn()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    own = {}
    for key, (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        c = category(key)
        own[c] = own.get(c, 0.0) + tottime
    total = sum(own.values()) or 1.0
    return {c: v / total * host_us for c, v in sorted(own.items(), key=lambda kv: -kv[1])}


def row(name, shape, fns, args, cuda):
    res = tp1.compare(fns, args, cuda)
    ms = {v: res[v][0] for v in fns}
    host = {v: res[v][1] for v in fns}
    r = dict(layer=name, shape="x".join(map(str, shape)), ms=ms, host_us=host,
             host_ratio={v: host[v] / host["bf16"] for v in fns if v != "bf16"},
             x={v: ms["bf16"] / ms[v] for v in fns if v != "bf16"})
    r["where"] = {v: breakdown(fns[v], args.batch, host[v], cuda) for v in ("bf16", "fp8_delayed")}
    return r


def run(args):
    import transformer_engine_c as tec
    from transformer_engine_c import recipe as recipe_mod

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    rows = []
    for layer in args.layers:
        if layer == "block":
            for shape in args.block_shapes:
                rows.append(row("block", shape, block_steps(tec, recipe_mod, shape, args.dtype, device), args, cuda))
            continue
        for shape in args.shapes:
            rows.append(row(layer, shape, layer_steps(tec, recipe_mod, layer, shape, args.dtype, device), args,
                            cuda))
    return rows


def table(rows):
    head = (f"{'layer':<16} {'shape':<16} {'bf16 us':>9} {'delayed us':>10} {'current us':>10} {'general us':>10} "
            f"{'host d':>7} {'host c':>7} {'host g':>7} {'bf16 ms':>9} {'x d':>6} {'x c':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        h, m = r["host_us"], r["ms"]
        hr = r["host_ratio"]
        lines.append(f"{r['layer']:<16} {r['shape']:<16} {h['bf16']:>9.1f} {h['fp8_delayed']:>10.1f} "
                     f"{h['fp8_current']:>10.1f} {h['fp8_delayed_general']:>10.1f} {hr['fp8_delayed']:>7.3f} "
                     f"{hr['fp8_current']:>7.3f} {hr['fp8_delayed_general']:>7.3f} {m['bf16']:>9.4f} "
                     f"{r['x']['fp8_delayed']:>6.3f} {r['x']['fp8_current']:>6.3f}")
    lines.append("us: host µs per step; host d / c / g: FP8 (delayed / current / delayed on the general path) host "
                 "µs over bf16's (target <= 1.15); x: bf16 ms / FP8 ms")
    lines += ["", "where the host time goes (µs per step, bf16 -> FP8 DelayedScaling):"]
    for r in rows:
        b, f = r["where"]["bf16"], r["where"]["fp8_delayed"]
        cats = sorted(set(b) | set(f), key=lambda c: -f.get(c, 0.0))
        parts = ", ".join(f"{c} {b.get(c, 0.0):.1f} -> {f.get(c, 0.0):.1f}" for c in cats)
        lines.append(f"  {r['layer']} {r['shape']}: {parts}")
    return "\n".join(lines)


def markdown(rows, meta):
    import json

    out = ["# transformer_engine_c --fp8 --host benchmark", "", json.dumps(meta), "",
           "host µs: the host's time to issue one eager forward+backward step (median); host ratio = FP8 µs / "
           "bf16 µs (target ≤ 1.15); x = bf16 ms / FP8 ms (device time).", "",
           "| layer | shape | bf16 host µs | FP8 delayed µs | FP8 current µs | FP8 delayed, general path µs | "
           "host ratio delayed | host ratio current | host ratio general | bf16 ms | x delayed | x current |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h, hr = r["host_us"], r["host_ratio"]
        out.append(f"| {r['layer']} | {r['shape']} | {h['bf16']:.1f} | {h['fp8_delayed']:.1f} | "
                   f"{h['fp8_current']:.1f} | {h['fp8_delayed_general']:.1f} | {hr['fp8_delayed']:.3f} | "
                   f"{hr['fp8_current']:.3f} | {hr['fp8_delayed_general']:.3f} | {r['ms']['bf16']:.4f} | "
                   f"{r['x']['fp8_delayed']:.3f} | {r['x']['fp8_current']:.3f} |")
    out += ["", "Where the host time goes (µs per step, cProfile's own time per category scaled to the measured "
            "host µs): bf16 → FP8 DelayedScaling.", ""]
    cats = [c for c, _ in CATEGORIES]
    out += ["| layer | shape | " + " | ".join(cats) + " |", "|---|---|" + "---|" * len(cats)]
    for r in rows:
        b, f = r["where"]["bf16"], r["where"]["fp8_delayed"]
        out.append(f"| {r['layer']} | {r['shape']} | " +
                   " | ".join(f"{b.get(c, 0.0):.1f} → {f.get(c, 0.0):.1f}" for c in cats) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    cuda = args.device == "cuda"
    rows = run(args)
    print(table(rows))
    if args.out:
        meta = tp1.meta_of(args, timing="device (CUDA events), host clock" if cuda else "host clock")
        tp1.write(args.out, "fp8_host", dict(meta=meta, rows=rows), markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
