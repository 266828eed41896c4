"""Summarise a torch.profiler chrome trace of GPU work (a diagnostic).

    python3 scripts/trace_summary.py TRACE.json [...]

For each trace: the span of the GPU work, and per stream its busy time (the
union of its kernels and copies), idle time inside the span, and the time by
category (GEMM, NCCL, norm, flag wait/signal, RS reduction, elementwise,
copies). The stream with the most GEMM time is the compute stream; its idle
time is what the overlap did not hide.
"""
import json
import re
import sys
from collections import defaultdict

CATEGORIES = (
    ("flag", re.compile(r"ct_wait|ct_signal")),
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


def summary(path):
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
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summary(p))
