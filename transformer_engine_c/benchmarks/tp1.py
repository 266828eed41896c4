"""Benchmark: each layer against the same layer built from torch.nn modules,
on one device (tensor-parallel size 1).

    python -m transformer_engine_c.bench --tp1 [--out bench_tp1]
    python -m transformer_engine_c.bench --tp1 --device cpu --shapes 64x64x128 --iters 3
    python -m transformer_engine_c.bench --tp1 --layers TransformerLayer --shapes 2048x2048x8192

Shapes are TOKENSxHIDDENxN: Linear and LayerNormLinear map HIDDEN to N
features, LayerNormMLP has hidden size HIDDEN and ffn_hidden_size N, and so
have TransformerLayer (causal self-attention, hidden_dropout and
attention_dropout 0) and ComposedBlock (--compile's block of our
LayerNormLinear, DotProductAttention, Linear and LayerNormMLP, ffn N: what
TransformerLayer is made of, composed by hand); MultiheadAttention is
TransformerLayer's attention (input_layernorm, causal, no dropout). These
three have --compile's geometry: sequences of min(TOKENS, 2048) tokens,
TOKENS / sequence of them, heads of 128 (of HIDDEN / 2 below 256), input
[sequence, batch, HIDDEN]; 2048x2048x8192 is --compile's block (ffn 4 x
HIDDEN). The PyTorch layers: nn.Linear; nn.LayerNorm then nn.Linear;
nn.LayerNorm, nn.Linear, tanh-GELU (TransformerEngine's "gelu"), nn.Linear;
for TransformerLayer and ComposedBlock --compile's TorchBlock (nn.LayerNorm,
one qkv nn.Linear, causal F.scaled_dot_product_attention, nn.Linear proj,
residual, then the MLP's modules and a residual), for MultiheadAttention its
attention half; all with the same parameter values. Each is timed forward+backward (grad_output given) and as
a no-grad forward. A sample is --batch calls issued back to back: "ms" is the
device time per call (CUDA events; the host clock on the CPU), "host us" the
host's time to issue one call (from the same samples). Ours and PyTorch's
are sampled in interleaved rounds, alternating which goes first; the figure is
the median over --iters samples. Results: a table on stdout, tp1.json and
tp1.md in --out; ratio = torch / ours (above 1: ours is faster). Where a
shape has both, a second table sets TransformerLayer against ComposedBlock
(its host µs over the block's: above 1, the layer adds host work of its own).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from .blocks import OurBlock, TorchAttention, TorchBlock, copy_into, geometry

GPU_SHAPES = [(512, 1024, 1024), (2048, 2048, 6144), (8192, 4096, 12288)]
CPU_SHAPES = [(64, 64, 128)]
LAYERS = ("Linear", "LayerNormLinear", "LayerNormMLP", "MultiheadAttention", "ComposedBlock", "TransformerLayer")
ATTENTION = ("MultiheadAttention", "ComposedBlock", "TransformerLayer")  # input [sequence, batch, HIDDEN]


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c.bench --tp1", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="comma-separated TOKENSxHIDDENxN")
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4, help="calls per timed sample")
    ap.add_argument("--out", default=None, help="directory for tp1.json / tp1.md")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    args.shapes = parse_shapes(ap, args.shapes) if args.shapes else (GPU_SHAPES if cuda else CPU_SHAPES)
    args.layers = [c for c in args.layers.split(",") if c]
    bad = [c for c in args.layers if c not in LAYERS]
    if bad:
        ap.error(f"unknown layer(s) {bad}; expected some of {LAYERS}")
    for layer in (c for c in args.layers if c in ATTENTION):
        for T, H, _ in args.shapes:
            try:
                layer_geometry(T, H)
            except ValueError as exc:
                ap.error(f"--shapes {T}x{H}x...: {layer}: {exc}")
    return sampling_defaults(ap, args, cuda, cpu_iters=5)


def sampling_defaults(ap, args, cuda, cpu_iters):
    """--dtype, --warmup and --iters defaulted for the device, --batch /
    --iters / --warmup checked (this benchmark's and the --fp8 one's)."""
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    args.iters = args.iters if args.iters is not None else (30 if cuda else cpu_iters)
    if args.batch < 1 or args.iters < 1 or args.warmup < 0:
        ap.error("--batch and --iters must be >= 1, --warmup >= 0")
    return args


def parse_shapes(ap, text):
    """[(tokens, hidden, n), ...] from --shapes' TOKENSxHIDDENxN[,...] (ap.error on a bad one)."""
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        ap.error(f"--shapes must be TOKENSxHIDDENxN[,...], got {text!r}")
    if any(len(s) != 3 or min(s) <= 0 for s in shapes):
        ap.error(f"--shapes must be three positive ints each, got {shapes}")
    return shapes


class TorchLNMLP(torch.nn.Module):
    """LayerNormMLP built from torch.nn modules."""

    def __init__(self, hidden, ffn, dtype, device):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden, eps=1e-5, dtype=dtype, device=device)
        self.fc1 = torch.nn.Linear(hidden, ffn, dtype=dtype, device=device)
        self.fc2 = torch.nn.Linear(ffn, hidden, dtype=dtype, device=device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def layer_geometry(tokens, hidden):
    """(sequence, batch, heads) of the attention layers at TOKENSxHIDDEN: --compile's
    geometry (ValueError where the tokens or heads do not divide evenly)."""
    seq, batch, heads = geometry(tokens, hidden)
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of its {heads} heads")
    return seq, batch, heads


def ours_layer(tec, layer, H, N, dtype, device):
    """Our layer of that name, HIDDEN -> N (LayerNormMLP, TransformerLayer,
    ComposedBlock: hidden H, ffn N; MultiheadAttention: hidden H)."""
    if layer in ATTENTION:
        heads = layer_geometry(1, H)[2]
        if layer == "TransformerLayer":
            return tec.TransformerLayer(H, N, heads, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                                        device=device)
        if layer == "MultiheadAttention":
            return tec.MultiheadAttention(H, heads, attention_dropout=0.0, input_layernorm=True,
                                          attn_mask_type="causal", params_dtype=dtype, device=device)
        return OurBlock(tec, H, heads, dtype, device, ffn=N)
    return getattr(tec, layer)(H, N, params_dtype=dtype, device=device)


def _attention_values(attn):
    """{TorchAttention's parameter name: our MultiheadAttention's value} (the
    qkv Linear's rows: our query, key and value weights, one after the other,
    as the layer splits them)."""
    qkv = attn.layernorm_qkv
    return {"ln1.weight": qkv.layer_norm_weight, "ln1.bias": qkv.layer_norm_bias,
            "qkv.weight": torch.cat([qkv.query_weight, qkv.key_weight, qkv.value_weight]),
            "qkv.bias": torch.cat([qkv.query_bias, qkv.key_bias, qkv.value_bias]),
            "proj.weight": attn.proj.weight, "proj.bias": attn.proj.bias}


def torch_transformer_layer(ours, H, N, dtype, device):
    """--compile's TorchBlock with the values of our TransformerLayer's
    parameters, copied by name."""
    ref = TorchBlock(H, layer_geometry(1, H)[2], dtype, device, ffn=N)
    mlp = ours.layernorm_mlp
    pairs = dict(_attention_values(ours.self_attention), **{
        "ln2.weight": mlp.layer_norm_weight, "ln2.bias": mlp.layer_norm_bias,
        "fc1.weight": mlp.fc1_weight, "fc1.bias": mlp.fc1_bias, "fc2.weight": mlp.fc2_weight,
        "fc2.bias": mlp.fc2_bias})
    ref.load_state_dict({name: value.detach() for name, value in pairs.items()})  # strict: every name
    return ref


def build(tec, layer, H, N, dtype, device):
    """(ours, PyTorch's) with the same parameter values."""
    ours = ours_layer(tec, layer, H, N, dtype, device)
    with torch.no_grad():
        if layer == "TransformerLayer":
            ref = torch_transformer_layer(ours, H, N, dtype, device)
        elif layer == "MultiheadAttention":
            ref = TorchAttention(H, layer_geometry(1, H)[2], dtype, device)
            ref.load_state_dict({name: value.detach() for name, value in _attention_values(ours).items()})
        elif layer == "ComposedBlock":
            ref = TorchBlock(H, layer_geometry(1, H)[2], dtype, device, ffn=N)
            copy_into(ours, ref)
        elif layer == "Linear":
            ref = torch.nn.Linear(H, N, dtype=dtype, device=device)
            ref.weight.copy_(ours.weight)
            ref.bias.copy_(ours.bias)
        elif layer == "LayerNormLinear":
            ref = torch.nn.Sequential(torch.nn.LayerNorm(H, dtype=dtype, device=device),
                                      torch.nn.Linear(H, N, dtype=dtype, device=device))
            ref[1].weight.copy_(ours.weight)
            ref[1].bias.copy_(ours.bias)
        else:
            ref = TorchLNMLP(H, N, dtype, device)
            ref.fc1.weight.copy_(ours.fc1_weight)
            ref.fc1.bias.copy_(ours.fc1_bias)
            ref.fc2.weight.copy_(ours.fc2_weight)
            ref.fc2.bias.copy_(ours.fc2_bias)
    return ours, ref


def steps(m, x, dy):
    """{mode: a callable running one call of m}."""
    def fwd_bwd():
        m(x).backward(dy)

    def fwd_nograd():
        with torch.no_grad():
            m(x)
    return {"fwd+bwd": fwd_bwd, "fwd (no_grad)": fwd_nograd}


def sample(fn, batch, cuda):
    """(device ms per call, host us per call) of one sample of `batch` calls."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(batch):
        fn()
    host = time.perf_counter() - t0
    if cuda:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / batch, host / batch * 1e6
    return host * 1e3 / batch, host / batch * 1e6


def compare(fns, args, cuda):
    """{name: (median ms, median host us)} of fns, sampled in interleaved
    rounds (the order alternating from round to round)."""
    names = list(fns)
    for _ in range(args.warmup):
        for n in names:
            fns[n]()
    ms, host = {n: [] for n in names}, {n: [] for n in names}
    for i in range(args.iters):
        for n in (names if i % 2 == 0 else names[::-1]):
            a, b = sample(fns[n], args.batch, cuda)
            ms[n].append(a)
            host[n].append(b)
    return {n: (statistics.median(ms[n]), statistics.median(host[n])) for n in names}


def run(args):
    import transformer_engine_c as tec

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    rows = []
    for T, H, N in args.shapes:
        for layer in args.layers:
            ours, ref = build(tec, layer, H, N, args.dtype, device)
            if layer in ATTENTION:
                seq, batch, _ = layer_geometry(T, H)
                in_shape = out_shape = (seq, batch, H)
            else:
                in_shape, out_shape = (T, H), (T, H if layer == "LayerNormMLP" else N)
            x = torch.randn(in_shape, dtype=args.dtype, device=device, requires_grad=True)
            dy = torch.randn(out_shape, dtype=args.dtype, device=device)
            a, b = steps(ours, x, dy), steps(ref, x, dy)
            for mode in a:
                res = compare({"ours": a[mode], "torch": b[mode]}, args, cuda)
                (om, oh), (tm, th) = res["ours"], res["torch"]
                rows.append(dict(layer=layer, mode=mode, tokens=T, hidden=H, n=N, ours_ms=om, torch_ms=tm,
                                 ms_ratio=tm / om, ours_host_us=oh, torch_host_us=th, host_ratio=oh / th))
            x.grad = None
            del ours, ref
    return rows


def against_block(rows):
    """TransformerLayer against ComposedBlock, for each shape and mode that
    has both rows: their ms and host µs, ms_ratio = block ms / layer ms
    (target >= 1.0) and host_ratio = layer µs / block µs (target <= 1.05)."""
    block = {(r["tokens"], r["hidden"], r["n"], r["mode"]): r for r in rows if r["layer"] == "ComposedBlock"}
    out = []
    for r in rows:
        b = block.get((r["tokens"], r["hidden"], r["n"], r["mode"])) if r["layer"] == "TransformerLayer" else None
        if b is not None:
            out.append(dict(mode=r["mode"], tokens=r["tokens"], hidden=r["hidden"], n=r["n"], layer_ms=r["ours_ms"],
                            block_ms=b["ours_ms"], ms_ratio=b["ours_ms"] / r["ours_ms"],
                            layer_host_us=r["ours_host_us"], block_host_us=b["ours_host_us"],
                            host_ratio=r["ours_host_us"] / b["ours_host_us"]))
    return out


def table(rows):
    head = (f"{'layer':<18} {'mode':<14} {'shape':<18} {'ours ms':>9} {'torch ms':>9} {'x':>6} "
            f"{'ours us':>9} {'torch us':>9} {'host':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['layer']:<18} {r['mode']:<14} {r['tokens']}x{r['hidden']}x{r['n']:<8} "
                     f"{r['ours_ms']:>9.4f} {r['torch_ms']:>9.4f} {r['ms_ratio']:>6.3f} "
                     f"{r['ours_host_us']:>9.1f} {r['torch_host_us']:>9.1f} {r['host_ratio']:>6.3f}")
    lines.append("x: torch ms / ours ms (target >= 1.0); host: ours host us / torch host us (target <= 1.0)")
    against = against_block(rows)
    if against:
        lines += ["", f"{'TransformerLayer vs ComposedBlock':<34} {'shape':<18} {'layer ms':>9} {'block ms':>9} "
                      f"{'x':>6} {'layer us':>9} {'block us':>9} {'host':>6}"]
        for a in against:
            lines.append(f"{a['mode']:<34} {a['tokens']}x{a['hidden']}x{a['n']:<8} {a['layer_ms']:>9.4f} "
                         f"{a['block_ms']:>9.4f} {a['ms_ratio']:>6.3f} {a['layer_host_us']:>9.1f} "
                         f"{a['block_host_us']:>9.1f} {a['host_ratio']:>6.3f}")
        lines.append("x: block ms / layer ms (target >= 1.0); host: layer host us / block host us (target <= 1.05)")
    return "\n".join(lines)


def markdown(rows, meta):
    out = ["# transformer_engine_c --tp1 benchmark", "", json.dumps(meta), "",
           "ms: device time per call (median); host µs: the host's time to issue one call. "
           "ratio = torch ms / ours ms (≥ 1.0: ours is not slower); host ratio = ours µs / torch µs.", "",
           "| layer | mode | shape | ours ms | torch ms | ratio | ours host µs | torch host µs | host ratio |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['layer']} | {r['mode']} | {r['tokens']}×{r['hidden']}×{r['n']} | {r['ours_ms']:.4f} | "
                   f"{r['torch_ms']:.4f} | {r['ms_ratio']:.3f} | {r['ours_host_us']:.1f} | "
                   f"{r['torch_host_us']:.1f} | {r['host_ratio']:.3f} |")
    against = against_block(rows)
    if against:
        out += ["", "TransformerLayer against the same block composed of our layers (ComposedBlock): "
                "ratio = block ms / layer ms (≥ 1.0), host ratio = layer µs / block µs (≤ 1.05).", "",
                "| mode | shape | layer ms | block ms | ratio | layer host µs | block host µs | host ratio |",
                "|---|---|---|---|---|---|---|---|"]
        for a in against:
            out.append(f"| {a['mode']} | {a['tokens']}×{a['hidden']}×{a['n']} | {a['layer_ms']:.4f} | "
                       f"{a['block_ms']:.4f} | {a['ms_ratio']:.3f} | {a['layer_host_us']:.1f} | "
                       f"{a['block_host_us']:.1f} | {a['host_ratio']:.3f} |")
    return "\n".join(out) + "\n"


def meta_of(args, **extra):
    """The run's facts that every benchmark's JSON and Markdown begin with."""
    return dict(device=(torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
                dtype=str(args.dtype).replace("torch.", ""), batch=args.batch, iters=args.iters,
                warmup=args.warmup, torch=torch.__version__, **extra)


def write(out, name, data, md):
    """NAME.json (data) and NAME.md (md) in the directory out."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    print(f"wrote {out}/{name}.json, {name}.md")


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    rows = run(args)
    print(table(rows))
    if args.out:
        meta = meta_of(args)
        write(args.out, "tp1", dict(meta=meta, rows=rows, against_block=against_block(rows)), markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
