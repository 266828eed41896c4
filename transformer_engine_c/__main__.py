"""The main job: train a small GPT-style decoder built of the package's layers
(tensor + sequence parallel attention and MLP blocks, userbuffers overlap,
tec.checkpoint around each block, optionally DistributedWeight, AdamW, the
saved-tensor checker on) on a generated language, twice from the same seed:
userbuffers overlap off, then on. It reports both loss curves and whether
they agree, the held-out loss, tokens/s, which overlapped paths ran on each
communicator, and the checker's result; --out DIR writes JSON (and a PNG of
the curves where matplotlib is installed).

    python -m transformer_engine_c                    # 2 CPU ranks, or every GPU
    python -m transformer_engine_c --steps 100 --layers 1 --out job_out
It launches its own ranks (through torch.distributed.run) unless it already
runs under torchrun. The model and loop are in transformer_engine_c/train.py.
"""
import argparse
import json
import os
import sys

import torch

from ._launch import init_rank, relaunch, under_torchrun

# Defaults: (CPU: a couple of minutes on two cores for both runs; GPUs)
DEFAULTS = {"cpu": dict(layers=2, hidden=64, heads=4, seq=64, batch=8, vocab=32, period=8, steps=300, lr=3e-3),
            "cuda": dict(layers=4, hidden=1024, heads=16, seq=1024, batch=8, vocab=256, period=32, steps=300,
                         lr=1e-3)}


def dflt(name):
    return f" (default {DEFAULTS['cpu'][name]:g} on CPU, {DEFAULTS['cuda'][name]:g} on GPUs)"


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_c", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpus else "cpu")
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks, all in one tensor-parallel group (default: 2 on CPU, every GPU)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run" + dflt("steps"))
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks" + dflt("layers"))
    ap.add_argument("--hidden", type=int, default=None, help="hidden size" + dflt("hidden"))
    ap.add_argument("--heads", type=int, default=None, help="attention heads, divisible by the ranks"
                    + dflt("heads"))
    ap.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 * hidden)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length, divisible by the ranks"
                    + dflt("seq"))
    ap.add_argument("--batch", type=int, default=None, help="sequences per step" + dflt("batch"))
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary of the generated language"
                    + dflt("vocab"))
    ap.add_argument("--period", type=int, default=None, help="length of the repeated part of each sequence"
                    + dflt("period"))
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW)" + dflt("lr"))
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="parameters and activations (default: float32 on CPU, bfloat16 on GPUs)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-overlap", action="store_true", help="one run, without userbuffers overlap")
    ap.add_argument("--distributed-weight", action="store_true",
                    help="the head's weight is a DistributedWeight sharded over the ranks (FSDP-style)")
    ap.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True,
                    help="activation checkpointing (tec.checkpoint) around each block")
    ap.add_argument("--compile", nargs="?", const="default", default=None, choices=["default", "reduce-overhead"],
                    help="train the model under torch.compile (fullgraph; mode reduce-overhead on GPUs only)")
    ap.add_argument("--out", default=None, metavar="DIR", help="write main_job.json (and main_job.png) here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not gpus:
        ap.error("--device cuda but no CUDA GPU is visible")
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.compile == "reduce-overhead" and args.device != "cuda":
        ap.error("--compile reduce-overhead needs CUDA GPUs (PyTorch's CUDA graphs)")
    if args.compile and args.distributed_weight:
        ap.error("--compile with --distributed-weight: a DistributedWeight cannot be traced by torch.compile "
                 "(its gather is a collective issued per call)")
    args.ffn = args.ffn or 4 * args.hidden
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.nproc = args.nproc or (gpus if args.device == "cuda" else 2)
    if args.device == "cuda" and args.nproc > gpus:
        ap.error(f"--nproc {args.nproc} but only {gpus} GPU(s) are visible")
    tp = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    problem = check_sizes(args, tp)
    if problem:
        ap.error(problem)
    return args


def check_sizes(args, tp):
    """A message naming the first option the sizes make impossible, or None."""
    for name in ("nproc", "steps", "layers", "hidden", "heads", "ffn", "seq", "batch", "vocab", "period"):
        v = tp if name == "nproc" else getattr(args, name)
        if v < 1:
            return f"--{name} must be >= 1, got {v}"
    if args.steps < 2:
        return f"--steps must be >= 2 (the first step is not timed), got {args.steps}"
    if not args.lr > 0:
        return f"--lr must be > 0, got {args.lr}"
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not divisible by --heads {args.heads}"
    for name in ("heads", "ffn", "seq"):
        if getattr(args, name) % tp:
            what = {"heads": "each rank computes heads/tp heads", "ffn": "the MLP's columns are split",
                    "seq": "sequence parallelism splits the sequence"}[name]
            return f"--{name} {getattr(args, name)} is not divisible by the {tp} tensor-parallel ranks ({what})"
    if args.distributed_weight and args.vocab % tp:
        return (f"--vocab {args.vocab} is not divisible by the {tp} ranks (--distributed-weight shards the "
                "head's weight along the vocabulary)")
    if args.period > args.seq:
        return f"--period {args.period} must be <= --seq {args.seq}"
    if args.period < 2:
        return f"--period must be >= 2, got {args.period}"
    return None


def worker(args):
    import torch.distributed as dist

    from . import train

    rank, size, device = init_rank(args.device)
    dtype = getattr(torch, args.dtype)
    tp = dist.new_group(list(range(size)))
    cfg = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "seq", "batch", "vocab", "period",
                                         "steps", "lr", "seed", "checkpoint", "distributed_weight", "compile")}
    data = train.MarkovCopyData(args.vocab, args.seq, args.period, n_train=max(512, 8 * args.batch),
                                n_heldout=4 * args.batch, seed=args.seed)
    optimal = data.optimal_loss(data.heldout)
    if rank == 0:
        print(f"transformer_engine_c main job: {size} ranks on {device.type} (one tensor-parallel group, "
              f"sequence parallel), {args.dtype}")
        print(f"  model: {args.layers} block{'s' if args.layers > 1 else ''}, hidden {args.hidden}, "
              f"{args.heads} heads, ffn {args.ffn}, "
              f"vocab {args.vocab}; activation checkpointing {'on' if args.checkpoint else 'off'}"
              + ("; head weight a DistributedWeight" if args.distributed_weight else "")
              + (f"; under torch.compile (mode {args.compile})" if args.compile else ""))
        print(f"  data: generated sequences of {args.seq} tokens (a Markov chain's first {args.period}, then "
              f"repeated), batch {args.batch}, {len(data.train)} training / {len(data.heldout)} held-out "
              f"sequences; the generator's own held-out loss is {optimal:.3f}", flush=True)
    modes = [False] if args.no_overlap or size == 1 else [False, True]
    if rank == 0 and size == 1 and not args.no_overlap:
        print("  one rank: no tensor-parallel communication to overlap, one run (overlap off)")
    tty = sys.stdout.isatty()
    runs = []
    for overlap in modes:
        label = f"overlap {'on ' if overlap else 'off'}"
        runs.append(train.run(cfg, data, overlap, device, dtype, tp, train.Progress(label, args.steps, rank == 0,
                                                                                   tty)))
    ok, summary = judge(runs, dtype)
    if rank == 0:
        report(args, size, device, runs, summary, optimal, ok)
    # Every rank waits for the report: a rank that exited first with a failure
    # would have torchrun kill rank 0 while it writes.
    dist.barrier(group=tp)
    dist.destroy_process_group()
    return 0 if ok else 1


def judge(runs, dtype):
    """(all checks passed, what each check found)."""
    from . import train

    s = {"loss_falls": all(train.falls(r["losses"]) for r in runs),
         "no_alias": all(r["alias_violations"] == 0 for r in runs)}
    on = [r for r in runs if r["overlap"]]
    if on:
        counts = {}
        for st in on[0]["stats"].values():
            for k, v in st.items():
                counts[k] = counts.get(k, 0) + v
        s["overlap_counts"] = counts
        # every overlapped path ran, and none fell back
        s["overlapped"] = (all(counts[k] > 0 for k in ("ag_overlap", "rs_overlap", "bulk_ag", "bulk_rs"))
                           and counts["ag_fallback"] == counts["rs_fallback"] == 0)
    if len(runs) == 2:
        window, tol = train.agreement_tolerance(dtype)
        gap = train.curve_gap(runs[1]["losses"], runs[0]["losses"], window)
        held = abs(runs[1]["heldout_end"] - runs[0]["heldout_end"]) / runs[0]["heldout_end"]
        s.update(curve_gap=gap, heldout_gap=held, window=window, tolerance=tol, agree=gap <= tol and held <= tol)
    ok = s["loss_falls"] and s["no_alias"] and s.get("overlapped", True) and s.get("agree", True)
    return ok, s


def report(args, size, device, runs, s, optimal, ok):
    def mean(x):
        return sum(x) / len(x)

    w = max(1, min(10, args.steps // 4))
    print()
    print(f"  {'run':<12}{'loss start':>11}{'loss end':>10}{'held-out':>10}{'tokens/s':>10}{'checked':>9}"
          f"{'aliases':>9}")
    for r in runs:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        print(f"  {'overlap ' + ('on' if r['overlap'] else 'off'):<12}{mean(r['losses'][:w]):>11.4f}"
              f"{mean(r['losses'][-w:]):>10.4f}{r['heldout_end']:>10.4f}{tps:>10}"
              f"{r['saved_tensors_checked']:>9}{r['alias_violations']:>9}")
    print(f"  (loss start/end: means of the first/last {w} steps; held-out before training "
          f"{runs[0]['heldout_start']:.4f}, the generator's own {optimal:.4f}; checked: tensors saved for "
          "backward that tec.debug.check_saved_tensors examined, aliases: those overlapping a userbuffer)")
    for r in runs:
        if r["stats"]:
            print("  overlapped paths run, per communicator (stats()):")
            for name, st in r["stats"].items():
                ran = ", ".join(f"{k}={v}" for k, v in st.items() if v)
                if ran:
                    print(f"    {name:<11} {ran}")
    if runs[0]["distributed_weight_gathers"]:
        print("  DistributedWeight all-gathers of the head's weight (forward, backward, held-out evaluation): "
              + ", ".join(f"overlap {'on' if r['overlap'] else 'off'} {r['distributed_weight_gathers']}"
                          for r in runs))
    print(f"  loss fell well below its start (last {w}-step mean < half the first): "
          f"{'yes' if s['loss_falls'] else 'NO'}")
    if "agree" in s:
        how = "step by step" if s["window"] == 1 else f"{s['window']}-step means"
        print(f"  overlap on vs off: loss curves differ by at most {s['curve_gap']:.2e} relative ({how}), "
              f"held-out by {s['heldout_gap']:.2e}; tolerance {s['tolerance']:g}: "
              f"{'agree' if s['agree'] else 'DISAGREE'}")
        r0, r1 = runs
        if r0["tokens_per_s"] and r1["tokens_per_s"]:
            print(f"  tokens/s overlap on / off: {r1['tokens_per_s'] / r0['tokens_per_s']:.2f}x"
                  + (f" ({size} CPU ranks on shared cores: a demonstration, not a speed measurement)"
                     if device.type == "cpu" else ""))
    if "overlapped" in s:
        print(f"  every overlapped path ran (ag_overlap, rs_overlap, bulk_ag, bulk_rs > 0, no fallback): "
              f"{'yes' if s['overlapped'] else 'NO'}")
    print(f"  saved-tensor checker: {'no saved tensor aliased a userbuffer' if s['no_alias'] else 'ALIAS FOUND'}")
    if args.out:
        write_out(args, size, device, runs, s, optimal, ok)
    print(f"  {'PASS' if ok else 'FAIL'}", flush=True)


def write_out(args, size, device, runs, s, optimal, ok):
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "main_job.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "ranks": size, "device": device.type, "optimal_heldout_loss": optimal,
                   "runs": runs, "checks": s, "pass": ok}, f, indent=1)
    print(f"  wrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed: no PNG)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"overlap {'on' if r['overlap'] else 'off'}",
                linestyle="--" if r["overlap"] else "-")
    ax.axhline(optimal, color="gray", linewidth=0.8, label="generator's own loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(f"transformer_engine_c main job: {size} ranks, {device.type}, {args.dtype}")
    ax.legend()
    fig.tight_layout()
    png = os.path.join(args.out, "main_job.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"  wrote {png}")


def main():
    args = parse()
    if not under_torchrun():
        return relaunch("transformer_engine_c", args.nproc)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
