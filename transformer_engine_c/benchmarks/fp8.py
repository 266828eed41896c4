"""Benchmark: FP8 training steps on one device, against our bf16 layers,
torchao float8 and torch.nn, judged against the FP8 targets (TARGETS).

    python -m transformer_engine_c.bench --fp8 [--out bench_fp8]
    python -m transformer_engine_c.bench --fp8 --graphs      (the graphs block only)
    python -m transformer_engine_c.bench --fp8 --device cpu --shapes 64x64x128 --iters 3

Shapes are TOKENSxHIDDENxN as in --tp1 (LayerNormMLP: hidden HIDDEN, ffn N).
Blocks, each timed forward+backward with grad_output given:
  LayerNormLinear, LayerNormMLP (gelu), Linear: ours in high precision
    ("ours"), ours under FP8 DelayedScaling and Float8CurrentScaling (the
    autocast entered per step around the forward, backward outside it, as in
    training: DelayedScaling's scale update runs at the autocast's exit),
    torchao float8 (tensorwise, convert_to_float8_training on the torch.nn
    block, under torch.compile) and the torch.nn block itself.
  gemm: our FP8 GEMM (E4M3 x E4M3, bf16 out, fast accumulation) against
    torch._scaled_mm with per-tensor scales (torch's side on CUDA only).
  memory: peak allocated memory of one FP8 (DelayedScaling) LayerNormMLP
    training step minus that of the high-precision step, against the bound
    of one FP8 copy and one FP8 transpose of every weight (2 bytes per
    weight element; the bf16 weights are in both steps). CUDA only.
  graphs: LayerNormMLP's fwd+bwd step captured with tec.make_graphed_callables,
    in bf16 ("ours_graphed") and in FP8 (fp8_enabled with DelayedScaling and
    Float8CurrentScaling; replayed under the autocast, so DelayedScaling's
    scale updates run outside the graphs at its exit and after the backward
    graph, as in training). CUDA only (the row says so elsewhere).
Sampling is --tp1's: a sample is --batch steps back to back, device time
from CUDA events (the host clock on the CPU), the variants of a row sampled
in interleaved rounds, the median of --iters samples. A variant that cannot
run (NotImplementedError, torchao not installed, CUDA only) keeps its reason
as its status and is left out of the rounds. ratio = the other's ms / ours.
Results: tables and a Targets table on stdout, fp8.json and fp8.md in --out.
On the CPU the numbers only show that every path runs: timing is not judged.
"""
import argparse
import copy
import json
import sys

import torch

from . import tp1

BIG_LINEAR = (8192, 4096, 12288)
BIG_MLP = (8192, 4096, 16384)
SMALL = (2048, 2048, 6144)
LAYER_BLOCKS = ("LayerNormLinear", "LayerNormMLP", "Linear")
BLOCKS = LAYER_BLOCKS + ("gemm", "memory", "graphs")
GPU_SHAPES = {"LayerNormLinear": [BIG_LINEAR, SMALL], "LayerNormMLP": [BIG_MLP, SMALL], "Linear": [BIG_LINEAR, SMALL],
              "gemm": [BIG_LINEAR, BIG_MLP, SMALL], "memory": [BIG_MLP], "graphs": [SMALL]}
CPU_SHAPE = (64, 64, 128)
VARIANTS = ("ours", "ours_fp8_delayed", "ours_fp8_current", "torchao_fp8", "torch")
GEMM_VARIANTS = ("ours_fp8_gemm", "torch_scaled_mm")
MEMORY_VARIANTS = ("ours", "ours_fp8_delayed")
GRAPH_VARIANTS = ("ours_graphed", "ours_fp8_delayed_graphed", "ours_fp8_current_graphed")
NO_GRAPHS = "skipped: CUDA graphs run on CUDA only"
OK = "ok"
NO_TORCHAO = "torchao not installed"

# (target, block, shape, ratio, need): met when the row's ratio >= need ("<=" for memory).
TARGETS = [
    ("LayerNormLinear fwd+bwd: FP8 DelayedScaling >= 1.5x our bf16", "LayerNormLinear", BIG_LINEAR,
     "fp8_delayed_vs_ours", 1.5),
    ("LayerNormLinear fwd+bwd: FP8 Float8CurrentScaling >= 1.4x our bf16", "LayerNormLinear", BIG_LINEAR,
     "fp8_current_vs_ours", 1.4),
    ("LayerNormMLP fwd+bwd: FP8 DelayedScaling >= 1.55x our bf16", "LayerNormMLP", BIG_MLP,
     "fp8_delayed_vs_ours", 1.55),
    ("ours FP8 DelayedScaling >= 1.25x torchao float8 compiled", "LayerNormLinear", BIG_LINEAR,
     "fp8_delayed_vs_torchao", 1.25),
    ("ours FP8 Float8CurrentScaling >= 1.25x torchao float8 compiled", "LayerNormLinear", BIG_LINEAR,
     "fp8_current_vs_torchao", 1.25),
    ("ours FP8 DelayedScaling >= 1.25x torchao float8 compiled", "LayerNormMLP", BIG_MLP,
     "fp8_delayed_vs_torchao", 1.25),
    ("ours FP8 Float8CurrentScaling >= 1.25x torchao float8 compiled", "LayerNormMLP", BIG_MLP,
     "fp8_current_vs_torchao", 1.25),
    ("small shape: FP8 DelayedScaling >= 1.0x our bf16", "LayerNormLinear", SMALL, "fp8_delayed_vs_ours", 1.0),
    ("small shape: FP8 Float8CurrentScaling >= 1.0x our bf16", "LayerNormLinear", SMALL, "fp8_current_vs_ours", 1.0),
    ("small shape: FP8 DelayedScaling >= 1.0x our bf16", "LayerNormMLP", SMALL, "fp8_delayed_vs_ours", 1.0),
    ("small shape: FP8 Float8CurrentScaling >= 1.0x our bf16", "LayerNormMLP", SMALL, "fp8_current_vs_ours", 1.0),
    ("our FP8 GEMM >= 0.97x torch._scaled_mm", "gemm", BIG_LINEAR, "fp8_gemm_vs_scaled_mm", 0.97),
    ("memory: FP8 step's extra over bf16 <= one FP8 copy + transpose per weight", "memory", BIG_MLP,
     "extra_vs_bound", 1.0),
    ("graphed LayerNormMLP fwd+bwd: FP8 DelayedScaling >= 1.3x our graphed bf16", "graphs", SMALL,
     "graphed_fp8_delayed_vs_graphed_ours", 1.3),
]
# ratio name: (numerator variant, denominator variant), both timed in ms
RATIOS = {"fp8_delayed_vs_ours": ("ours", "ours_fp8_delayed"), "fp8_current_vs_ours": ("ours", "ours_fp8_current"),
          "fp8_delayed_vs_torchao": ("torchao_fp8", "ours_fp8_delayed"),
          "fp8_current_vs_torchao": ("torchao_fp8", "ours_fp8_current"), "ours_vs_torch": ("torch", "ours"),
          "torchao_vs_torch": ("torch", "torchao_fp8"), "fp8_delayed_vs_torch": ("torch", "ours_fp8_delayed"),
          "fp8_gemm_vs_scaled_mm": ("torch_scaled_mm", "ours_fp8_gemm"),
          "graphed_fp8_delayed_vs_graphed_ours": ("ours_graphed", "ours_fp8_delayed_graphed"),
          "graphed_fp8_current_vs_graphed_ours": ("ours_graphed", "ours_fp8_current_graphed")}


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c.bench --fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="comma-separated TOKENSxHIDDENxN, for every block (default: "
                    "each block's own GPU shapes; on the CPU 64x64x128)")
    ap.add_argument("--blocks", default=",".join(BLOCKS), help=f"comma-separated, of {', '.join(BLOCKS)}")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="high-precision dtype (default bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4, help="steps per timed sample")
    ap.add_argument("--no-compile", action="store_true", help="run torchao's block eagerly (not its target's form)")
    ap.add_argument("--out", default=None, help="directory for fp8.json / fp8.md")
    ap.add_argument("--graphs", action="store_true", help="the graphs block only (same as --blocks graphs)")
    args = ap.parse_args(argv)
    if args.graphs:
        args.blocks = "graphs"
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    args.blocks = [b for b in args.blocks.split(",") if b]
    bad = [b for b in args.blocks if b not in BLOCKS]
    if bad:
        ap.error(f"unknown block(s) {bad}; expected some of {BLOCKS}")
    if args.shapes:
        shapes = tp1.parse_shapes(ap, args.shapes)
        args.shapes = {b: shapes for b in BLOCKS}
    else:
        args.shapes = GPU_SHAPES if cuda else {b: [CPU_SHAPE] for b in BLOCKS}
    return tp1.sampling_defaults(ap, args, cuda, cpu_iters=3)


def why(exc):
    """A failed variant's status: the exception's type and first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def probe(fns, status, cuda):
    """Run each fn once (compiles, first-call setup); a failure becomes
    that variant's status. Returns the fns that ran."""
    ran = {}
    for name, fn in fns.items():
        try:
            fn()
            if cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # the row reports it; the other variants still run
            status[name] = why(exc)
        else:
            status[name] = OK
            ran[name] = fn
    return ran


def load_torchao():
    """torchao.float8's (convert_to_float8_training, Float8LinearConfig), or None."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    return convert_to_float8_training, Float8LinearConfig


def torchao_block(ao, ref, compile_it):
    """A copy of the torch.nn block with its nn.Linear layers converted to
    torchao float8 (tensorwise dynamic scaling), compiled."""
    convert, config = ao
    block = convert(copy.deepcopy(ref), config=config.from_recipe_name("tensorwise"))
    return torch.compile(block) if compile_it else block


def fp8_twin(tec, layer, H, N, dtype, device, ours):
    """Another of our layers with ours' parameter values (one per recipe: a
    layer's FP8 state belongs to one recipe)."""
    twin = tp1.ours_layer(tec, layer, H, N, dtype, device)
    with torch.no_grad():
        for (name, p), (name_o, q) in zip(twin.named_parameters(), ours.named_parameters()):
            assert name == name_o, (name, name_o)
            p.copy_(q)
    return twin


def fp8_step(tec, m, x, dy, recipe):
    """One training step of m under an FP8 autocast entered for this step."""
    def step():
        with tec.autocast(enabled=True, recipe=recipe):
            y = m(x)
        y.backward(dy)
    return step


def _ratio(ms, a, b):
    return ms[a] / ms[b] if a in ms and b in ms and ms[b] > 0 else None


def timed_row(block, shape, fns, status, order, args, cuda):
    """A row of the variants in fns, sampled together; status (variant:
    reason) already holds those that could not be built, and order names
    every variant of the row."""
    res = tp1.compare(probe(fns, status, cuda), args, cuda)
    ms = {n: v[0] for n, v in res.items()}
    T, H, N = shape
    return dict(block=block, tokens=T, hidden=H, n=N, status={n: status[n] for n in order}, ms=ms,
                host_us={n: v[1] for n, v in res.items()},
                ratios={r: _ratio(ms, a, b) for r, (a, b) in RATIOS.items() if a in order and b in order})


def layer_row(tec, recipe_mod, ao, layer, shape, args, device):
    cuda = device.type == "cuda"
    T, H, N = shape
    ours, ref = tp1.build(tec, layer, H, N, args.dtype, device)
    delayed = fp8_twin(tec, layer, H, N, args.dtype, device, ours)
    current = fp8_twin(tec, layer, H, N, args.dtype, device, ours)
    x = torch.randn(T, H, dtype=args.dtype, device=device, requires_grad=True)
    dy = torch.randn(T, H if layer == "LayerNormMLP" else N, dtype=args.dtype, device=device)
    status = {}
    fns = {"ours": tp1.steps(ours, x, dy)["fwd+bwd"],
           "ours_fp8_delayed": fp8_step(tec, delayed, x, dy, recipe_mod.DelayedScaling()),
           "ours_fp8_current": fp8_step(tec, current, x, dy, recipe_mod.Float8CurrentScaling())}
    if ao is None:
        status["torchao_fp8"] = NO_TORCHAO
    else:
        try:
            fns["torchao_fp8"] = tp1.steps(torchao_block(ao, ref, not args.no_compile), x, dy)["fwd+bwd"]
        except Exception as exc:
            status["torchao_fp8"] = why(exc)
    fns["torch"] = tp1.steps(ref, x, dy)["fwd+bwd"]
    row = timed_row(layer, shape, fns, status, VARIANTS, args, cuda)
    torch._dynamo.reset()  # the next row's torchao block compiles afresh, within the recompile limit
    return row


def gemm_row(shape, args, device):
    from .. import _fp8_engine as F

    cuda = device.type == "cuda"
    e4m3 = torch.float8_e4m3fn
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(1)

    def quantized(rows):
        hp = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16)
        scale, _ = F.scale_from_amax(F.amax(hp), e4m3)
        data, _, scale_inv = F.quantize(hp, e4m3, scale)
        return data, scale_inv
    (a, sa), (b, sb) = quantized(m), quantized(n)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    fns = {"ours_fp8_gemm": lambda: F.fp8_gemm(a, sa, e4m3, b, sb, e4m3, out=out, use_split_accumulator=False)}
    status = {}
    if cuda:
        a8, bt8 = a.view(e4m3), b.view(e4m3).t()
        fns["torch_scaled_mm"] = lambda: torch._scaled_mm(a8, bt8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                           use_fast_accum=True)
    else:
        status["torch_scaled_mm"] = "skipped: torch._scaled_mm is compared on CUDA only"
    return timed_row("gemm", shape, fns, status, GEMM_VARIANTS, args, cuda)


def step_peak(make, tec, recipe, x, dy, device):
    """(peak bytes allocated by one training step of a fresh layer, above
    what was allocated before the layer was made, after one warm-up step;
    the number of its weight elements)."""
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    m = make()
    step = tp1.steps(m, x, dy)["fwd+bwd"] if recipe is None else fp8_step(tec, m, x, dy, recipe)
    step()
    for p in m.parameters():
        p.grad = None
    x.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    weights = sum(p.numel() for p in m.parameters() if p.dim() == 2)
    x.grad = None
    return peak, weights


def memory_row(tec, recipe_mod, shape, args, device):
    T, H, N = shape
    row = dict(block="memory", tokens=T, hidden=H, n=N, status={}, bytes={}, ratios={"extra_vs_bound": None})
    if device.type != "cuda":
        row["status"] = {n: "skipped: peak memory is measured on CUDA only" for n in MEMORY_VARIANTS}
        return row
    x = torch.randn(T, H, dtype=args.dtype, device=device, requires_grad=True)
    dy = torch.randn(T, H, dtype=args.dtype, device=device)

    def make():
        return tp1.ours_layer(tec, "LayerNormMLP", H, N, args.dtype, device)
    peaks = {}
    for _ in range(2):  # a first round leaves what the process keeps (workspaces) out of the second's counts
        for name, recipe in zip(MEMORY_VARIANTS, (None, recipe_mod.DelayedScaling())):
            try:
                peaks[name], weights = step_peak(make, tec, recipe, x, dy, device)
            except Exception as exc:
                peaks.pop(name, None)
                row["status"][name] = why(exc)
            else:
                row["status"][name] = OK
    if len(peaks) == 2:
        extra = peaks["ours_fp8_delayed"] - peaks["ours"]
        bound = 2 * weights  # one E4M3 byte for the copy, one for the transpose
        row["bytes"] = dict(ours_peak=peaks["ours"], fp8_peak=peaks["ours_fp8_delayed"], extra=extra, bound=bound,
                            weights_hp=weights * torch.finfo(args.dtype).bits // 8)
        row["ratios"]["extra_vs_bound"] = extra / bound
    return row


def graphs_row(tec, recipe_mod, shape, args, device):
    """Graphed LayerNormMLP steps: bf16 and FP8 (both recipes), each layer
    captured with its own parameters' copy; on the CPU every variant says
    why it did not run."""
    T, H, N = shape
    if device.type != "cuda":
        return dict(block="graphs", tokens=T, hidden=H, n=N, status={n: NO_GRAPHS for n in GRAPH_VARIANTS}, ms={},
                    host_us={}, ratios={r: None for r in RATIOS if r.startswith("graphed_")})
    ours = tp1.ours_layer(tec, "LayerNormMLP", H, N, args.dtype, device)
    x = torch.randn(T, H, dtype=args.dtype, device=device, requires_grad=True)
    dy = torch.randn(T, H, dtype=args.dtype, device=device)
    fns, status = {}, {}
    for name, recipe in zip(GRAPH_VARIANTS, (None, recipe_mod.DelayedScaling(), recipe_mod.Float8CurrentScaling())):
        layer = ours if recipe is None else fp8_twin(tec, "LayerNormMLP", H, N, args.dtype, device, ours)
        try:  # the sample is x itself: a replay copies no input
            g = tec.make_graphed_callables(layer, (x,), fp8_enabled=recipe is not None, fp8_recipe=recipe)
        except Exception as exc:
            status[name] = why(exc)
            continue
        fns[name] = tp1.steps(g, x, dy)["fwd+bwd"] if recipe is None else fp8_step(tec, g, x, dy, recipe)
    return timed_row("graphs", shape, fns, status, GRAPH_VARIANTS, args, True)


def targets(rows, cuda, have_torchao):
    """One entry per TARGETS line: the ratio where its row ran, and
    PASS / MISS on CUDA; otherwise the reason it was not judged (torchao's
    absence first: it holds for every shape)."""
    out = []
    for name, block, shape, ratio, need in TARGETS:
        label = f"{block} {'x'.join(map(str, shape))}"
        row = next((r for r in rows if r["block"] == block and (r["tokens"], r["hidden"], r["n"]) == shape), None)
        value = row["ratios"].get(ratio) if row else None
        if not have_torchao and "torchao_fp8" in RATIOS.get(ratio, ()):
            status = NO_TORCHAO
        elif row is None:
            status = f"not run: no {label} row"
        elif value is None:
            bad = [row["status"].get(v, "not run") for v in RATIOS.get(ratio, MEMORY_VARIANTS)
                   if row["status"].get(v) != OK]
            status = bad[0] if bad else "not measured"
        elif not cuda:
            status = "not judged: CPU timing"
        else:
            met = value <= need if block == "memory" else value >= need
            status = "PASS" if met else "MISS"
        out.append(dict(target=name, row=label, ratio=value, need=("<= " if block == "memory" else ">= ") + str(need),
                        status=status))
    return out


def run(args):
    import transformer_engine_c as tec
    from transformer_engine_c import recipe as recipe_mod

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    ao = load_torchao()
    rows = []
    for block in args.blocks:
        for shape in args.shapes[block]:
            if block == "memory":
                rows.append(memory_row(tec, recipe_mod, shape, args, device))
            elif block == "gemm":
                rows.append(gemm_row(shape, args, device))
            elif block == "graphs":
                rows.append(graphs_row(tec, recipe_mod, shape, args, device))
            else:
                rows.append(layer_row(tec, recipe_mod, ao, block, shape, args, device))
            print(f"done {block} {'x'.join(map(str, shape))}", file=sys.stderr, flush=True)
    return rows, ao is not None


def _ms(row, name):
    v = row["ms"].get(name)
    return f"{v:.4f}" if v is not None else "-"


def _x(v):
    return f"{v:.3f}" if v is not None else "-"


def table(rows, checks):
    lines = []
    layers = [r for r in rows if r["block"] in LAYER_BLOCKS]
    if layers:
        head = (f"{'block':<16} {'shape':<18} {'ours':>9} {'fp8 dly':>9} {'fp8 cur':>9} {'torchao':>9} {'torch':>9} "
                f"{'x dly':>6} {'x cur':>6} {'ao/dly':>6} {'ao/cur':>6}")
        lines += [head, "-" * len(head)]
        for r in layers:
            q = r["ratios"]
            lines.append(f"{r['block']:<16} {r['tokens']}x{r['hidden']}x{r['n']:<8} " +
                         " ".join(f"{_ms(r, v):>9}" for v in VARIANTS) + " " +
                         " ".join(f"{_x(q[k]):>6}" for k in ("fp8_delayed_vs_ours", "fp8_current_vs_ours",
                                                               "fp8_delayed_vs_torchao", "fp8_current_vs_torchao")))
        lines.append("ms per fwd+bwd step (median); x dly / x cur: ours ms / FP8 ms; ao/...: torchao ms / ours FP8 ms")
    for r in rows:
        if r["block"] == "gemm":
            lines.append(f"gemm {r['tokens']}x{r['hidden']}x{r['n']}: ours FP8 {_ms(r, 'ours_fp8_gemm')} ms, "
                         f"torch._scaled_mm {_ms(r, 'torch_scaled_mm')} ms, "
                         f"ratio {_x(r['ratios']['fp8_gemm_vs_scaled_mm'])}")
        elif r["block"] == "graphs":
            q = r["ratios"]
            lines.append(f"graphs LayerNormMLP {r['tokens']}x{r['hidden']}x{r['n']}: graphed bf16 "
                         f"{_ms(r, 'ours_graphed')} ms, FP8 delayed {_ms(r, 'ours_fp8_delayed_graphed')} ms "
                         f"(x {_x(q['graphed_fp8_delayed_vs_graphed_ours'])}), FP8 current "
                         f"{_ms(r, 'ours_fp8_current_graphed')} ms (x {_x(q['graphed_fp8_current_vs_graphed_ours'])})")
        elif r["block"] == "memory" and r["bytes"]:
            b = r["bytes"]
            lines.append(f"memory LayerNormMLP {r['tokens']}x{r['hidden']}x{r['n']}: peak {b['ours_peak'] / 2**20:.1f} "
                         f"MiB (ours) / {b['fp8_peak'] / 2**20:.1f} MiB (FP8), extra {b['extra'] / 2**20:.1f} MiB, "
                         f"bound {b['bound'] / 2**20:.1f} MiB, ratio {_x(r['ratios']['extra_vs_bound'])}")
    for r in rows:
        for name, s in r["status"].items():
            if s != OK:
                lines.append(f"status: {r['block']} {r['tokens']}x{r['hidden']}x{r['n']} {name}: {s}")
    lines += ["", "Targets", f"{'target':<76} {'row':<28} {'ratio':>7} {'need':>7}  status"]
    for t in checks:
        lines.append(f"{t['target']:<76} {t['row']:<28} {_x(t['ratio']):>7} {t['need']:>7}  {t['status']}")
    return "\n".join(lines)


def markdown(rows, checks, meta):
    out = ["# transformer_engine_c --fp8 benchmark", "", json.dumps(meta), "",
           "ms: device time per forward+backward step (median; the host clock on the CPU). "
           "x: ours (high precision) ms / ours FP8 ms; vs torchao: torchao ms / ours FP8 ms.", "",
           "| block | shape | " + " | ".join(f"{v} ms" for v in VARIANTS) +
           " | x delayed | x current | vs torchao (delayed) | vs torchao (current) |",
           "|---|---|" + "---|" * (len(VARIANTS) + 4)]
    for r in rows:
        if r["block"] in LAYER_BLOCKS:
            q = r["ratios"]
            out.append(f"| {r['block']} | {r['tokens']}×{r['hidden']}×{r['n']} | " +
                       " | ".join(_ms(r, v) for v in VARIANTS) + " | " +
                       " | ".join(_x(q[k]) for k in ("fp8_delayed_vs_ours", "fp8_current_vs_ours",
                                                     "fp8_delayed_vs_torchao", "fp8_current_vs_torchao")) + " |")
    out += ["", "## FP8 GEMM", "", "| shape | ours FP8 ms | torch._scaled_mm ms | ratio |", "|---|---|---|---|"]
    for r in rows:
        if r["block"] == "gemm":
            out.append(f"| {r['tokens']}×{r['hidden']}×{r['n']} | {_ms(r, 'ours_fp8_gemm')} | "
                       f"{_ms(r, 'torch_scaled_mm')} | {_x(r['ratios']['fp8_gemm_vs_scaled_mm'])} |")
    out += ["", "## Memory (LayerNormMLP step, MiB)", "", "| shape | ours peak | FP8 peak | extra | bound | ratio |",
            "|---|---|---|---|---|---|"]
    for r in rows:
        if r["block"] == "memory":
            b = r["bytes"]
            cells = [f"{b[k] / 2**20:.1f}" for k in ("ours_peak", "fp8_peak", "extra", "bound")] if b else ["-"] * 4
            out.append(f"| {r['tokens']}×{r['hidden']}×{r['n']} | " + " | ".join(cells) +
                       f" | {_x(r['ratios']['extra_vs_bound'])} |")
    out += ["", "## CUDA graphs (LayerNormMLP fwd+bwd, graphed)", "",
            "| shape | bf16 ms | FP8 delayed ms | FP8 current ms | x delayed | x current |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["block"] == "graphs":
            q = r["ratios"]
            out.append(f"| {r['tokens']}×{r['hidden']}×{r['n']} | " +
                       " | ".join(_ms(r, v) for v in GRAPH_VARIANTS) + " | " +
                       f"{_x(q['graphed_fp8_delayed_vs_graphed_ours'])} | "
                       f"{_x(q['graphed_fp8_current_vs_graphed_ours'])} |")
    out += ["", "## Status", ""]
    for r in rows:
        for name, s in r["status"].items():
            if s != OK:
                out.append(f"* {r['block']} {r['tokens']}×{r['hidden']}×{r['n']} {name}: {s}")
    out += ["", "## Targets", "", "| target | row | ratio | need | status |", "|---|---|---|---|---|"]
    for t in checks:
        out.append(f"| {t['target']} | {t['row']} | {_x(t['ratio'])} | {t['need']} | {t['status']} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    cuda = args.device == "cuda"
    if not cuda:
        print("CPU: tiny shapes, to check that every path runs; the timings mean nothing", flush=True)
    rows, have_torchao = run(args)
    checks = targets(rows, cuda, have_torchao)
    print(table(rows, checks))
    if args.out:
        ao_version = None
        if have_torchao:
            import torchao
            ao_version = torchao.__version__
        meta = tp1.meta_of(args, torchao=ao_version, torchao_compiled=not args.no_compile,
                           timing="device (CUDA events)" if cuda else "host clock; not judged")
        tp1.write(args.out, "fp8", dict(meta=meta, rows=rows, targets=checks), markdown(rows, checks, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
