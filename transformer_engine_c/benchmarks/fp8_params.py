"""Benchmark row: FP8 primary weights (quantized_model_init) against bf16
parameters, as memory facts.

    python -m transformer_engine_c.bench --fp8 --fp8-params [--out bench_fp8_params]
    python -m transformer_engine_c.bench --fp8 --fp8-params --device cpu --hidden 256 --tokens 64

The model is a LayerNormMLP (hidden H, ffn 4H, gelu) followed by a
LayerNormLinear (H -> 3H, a QKV projection), in bf16. Reported:
  * parameter bytes of the bf16 model and of the same model built under
    quantized_model_init (Float8Tensor weights: one byte per element plus a
    scale; norms and biases stay bf16), measured after construction and
    again after one training step (the cached transposes are dropped by the
    optimizer's in-place update), and their ratio (target <= 0.6);
  * on CUDA, the peak allocated memory of one training step (forward in an
    FP8 autocast of --recipe, backward, SGD step) of each model, above what
    was allocated before the model was made, after a warm-up step.
Memory only: nothing is timed. Results on stdout and, with --out,
fp8_params.json / fp8_params.md there."""
import argparse
import gc
import json
import os
import sys

import torch

TARGET = 0.6  # FP8-primary parameter bytes / bf16 parameter bytes


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c.bench --fp8 --fp8-params",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size H (a multiple of 16)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the training step (a multiple of 16)")
    ap.add_argument("--recipe", choices=["delayed", "current", "block"], default="delayed")
    ap.add_argument("--out", default=None, help="directory for fp8_params.json / fp8_params.md")
    args = ap.parse_args(argv)
    for name in ("hidden", "tokens"):
        v = getattr(args, name)
        if v <= 0 or v % 16:
            ap.error(f"--{name} must be a positive multiple of 16, got {v}")
    return args


def param_bytes(model):
    """Bytes the model's parameters hold: a quantized parameter's storages
    (FP8 data, transpose when kept, scale), a plain one's elements."""
    total = 0
    for p in model.parameters():
        total += p.storage_bytes() if hasattr(p, "storage_bytes") else p.numel() * p.element_size()
    return total


def build(tec, hidden, fp8_params, recipe, device):
    """The bf16 LayerNormMLP + LayerNormLinear model, its weights in FP8
    when fp8_params."""
    with tec.quantized_model_init(enabled=fp8_params, recipe=recipe):
        return torch.nn.Sequential(
            tec.LayerNormMLP(hidden, 4 * hidden, params_dtype=torch.bfloat16, device=device),
            tec.LayerNormLinear(hidden, 3 * hidden, params_dtype=torch.bfloat16, device=device))


def train_step(tec, model, x, recipe, opt):
    """Forward in the FP8 autocast, backward, optimizer step."""
    with tec.autocast(enabled=True, recipe=recipe):
        y = model(x)
    y.float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(tec, args, fp8_params, recipe, device):
    """(parameter bytes after construction, after one step, peak step bytes
    on CUDA or None)."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    model = build(tec, args.hidden, fp8_params, recipe, device)
    built = param_bytes(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    train_step(tec, model, x, recipe, opt)  # warm-up
    stepped = param_bytes(model)
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(tec, model, x, recipe, opt)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    del model, opt, x
    return built, stepped, peak


def run(args):
    import transformer_engine_c as tec
    from transformer_engine_c import recipe as recipe_mod

    device = torch.device(args.device)
    recipe = {"delayed": recipe_mod.DelayedScaling, "current": recipe_mod.Float8CurrentScaling,
              "block": recipe_mod.Float8BlockScaling}[args.recipe]()
    hp = measure(tec, args, False, recipe, device)
    fp8 = measure(tec, args, True, recipe, device)
    ratio = max(fp8[0], fp8[1]) / hp[0]
    row = dict(block="fp8_params", hidden=args.hidden, ffn=4 * args.hidden, qkv=3 * args.hidden,
               tokens=args.tokens, recipe=type(recipe).__name__,
               bytes=dict(bf16_params=hp[0], fp8_params=fp8[0], fp8_params_after_step=fp8[1],
                          bf16_step_peak=hp[2], fp8_step_peak=fp8[2]),
               ratios=dict(params_fp8_vs_bf16=ratio,
                           step_peak_fp8_vs_bf16=None if hp[2] is None else fp8[2] / hp[2]),
               target=f"FP8-primary parameter bytes <= {TARGET}x bf16", status="PASS" if ratio <= TARGET else "MISS")
    return row


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(row):
    b, r = row["bytes"], row["ratios"]
    peak = "-" if r["step_peak_fp8_vs_bf16"] is None else f"{r['step_peak_fp8_vs_bf16']:.3f}"
    lines = [f"FP8 primary weights: LayerNormMLP({row['hidden']}, {row['ffn']}) + LayerNormLinear({row['hidden']}, "
             f"{row['qkv']}), {row['recipe']}, {row['tokens']} tokens",
             "| | bf16 params | FP8 params | ratio |", "|---|---|---|---|",
             f"| parameter MiB (built) | {_mib(b['bf16_params'])} | {_mib(b['fp8_params'])} | "
             f"{b['fp8_params'] / b['bf16_params']:.3f} |",
             f"| parameter MiB (after a step) | {_mib(b['bf16_params'])} | {_mib(b['fp8_params_after_step'])} | "
             f"{b['fp8_params_after_step'] / b['bf16_params']:.3f} |",
             f"| training step peak MiB (CUDA) | {_mib(b['bf16_step_peak'])} | {_mib(b['fp8_step_peak'])} | {peak} |",
             f"target: {row['target']}: {row['status']} ({r['params_fp8_vs_bf16']:.3f})"]
    return "\n".join(lines)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    row = run(args)
    text = table(row)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__)
        with open(os.path.join(args.out, "fp8_params.json"), "w") as f:
            json.dump(dict(meta=meta, rows=[row]), f, indent=1)
        with open(os.path.join(args.out, "fp8_params.md"), "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}/fp8_params.json, fp8_params.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
