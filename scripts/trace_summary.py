"""Summarise a torch.profiler chrome trace of GPU work (a diagnostic).

    python3 scripts/trace_summary.py [--timeline=N] TRACE.json [...]

For each trace: the span of the GPU work, and per stream its busy time (the
union of its kernels and copies), idle time inside the span, and the time by
category (GEMM, NCCL, norm, flag wait/signal, RS reduction, elementwise,
copies). The stream with the most GEMM time is the compute stream; its idle
time is what the overlap did not hide. --timeline=N also lists the last N
GPU operations of each trace in time order.
"""
import json
import re
import sys
from collections import defaultdict

CATEGORIES = (
    ("flag", re.compile(r"ct_wait|ct_signal|ct_flags")),
    ("reduce", re.compile(r"ct_reduce")),
    ("nccl", re.compile(r"nccl", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("gemm", re.compile(r"gemm|sm90|cutlass|nvjet|xmma|Kernel2", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def category(ev):
    name = ev.get("name", "")
    if ev.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "elementwise"


def union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summary(path, timeline=0):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return f"{path}: no GPU events"
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    streams = defaultdict(list)
    for e in gpu:
        streams[(e.get("pid"), e.get("tid"))].append(e)
    lines = [f"{path}: GPU span {(t1 - t0) / 1e3:.3f} ms"]
    for key, evs in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in evs])
        cats = defaultdict(float)
        for e in evs:
            cats[category(e)] += e["dur"]
        parts = ", ".join(f"{c} {v / 1e3:.3f}" for c, v in sorted(cats.items(), key=lambda kv: -kv[1]))
        lines.append(f"  stream {key[1]}: {len(evs)} ops, busy {busy / 1e3:.3f} ms, idle in span "
                     f"{(t1 - t0 - busy) / 1e3:.3f} ms; {parts}")
        names = defaultdict(lambda: [0, 0.0])
        for e in evs:
            n = names[e.get("name", "?")[:70]]
            n[0] += 1
            n[1] += e["dur"]
        for name, (count, dur) in sorted(names.items(), key=lambda kv: -kv[1][1])[:8]:
            lines.append(f"      {dur / 1e3:8.3f} ms {count:4d}x {name}")
    lines += gaps(max(streams.values(), key=lambda evs: sum(e["dur"] for e in evs if category(e) == "gemm")))
    if timeline:
        last = sorted(gpu, key=lambda e: e["ts"])[-timeline:]
        lines.append(f"  the last {len(last)} GPU ops (start in us after the first of them at {last[0]['ts']:.1f}):")
        for e in last:
            lines.append(f"      {e['ts'] - last[0]['ts']:9.1f} {e['dur']:8.1f}  stream {e.get('tid')}  "
                         f"{short(e.get('name', '?'))}")
    return "\n".join(lines)


def short(name):
    """A kernel's name without namespaces, arguments and template noise
    (elementwise kernels keep their functor's name)."""
    name = name.replace("(anonymous namespace)::", "")
    if "elementwise_kernel" in name:
        functors = re.findall(r"native::(\w+)", name)
        return "elementwise " + (functors[1] if len(functors) > 1 else "?")
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"[(<].*$", "", name)
    return name.split("::")[-1][:40]


def gaps(evs):
    """The compute stream's idle gaps: total by (op before, op after), largest first."""
    evs = sorted(evs, key=lambda e: e["ts"])
    pairs = defaultdict(lambda: [0, 0.0])
    small = 0.0
    for a, b in zip(evs, evs[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap <= 0:
            continue
        if gap < 5:
            small += gap
            continue
        p = pairs[(short(a.get("name", "?")), short(b.get("name", "?")))]
        p[0] += 1
        p[1] += gap
    out = [f"  compute stream gaps: {small / 1e3:.3f} ms in gaps under 5 us; larger ones by (before -> after):"]
    for (a, b), (count, total) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:12]:
        out.append(f"      {total / 1e3:8.3f} ms {count:4d}x {a} -> {b}")
    return out


if __name__ == "__main__":
    timeline = 0
    paths = sys.argv[1:]
    if paths and paths[0].startswith("--timeline="):
        timeline = int(paths.pop(0).split("=", 1)[1])
    for p in paths:
        print(summary(p, timeline))
