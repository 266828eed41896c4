"""Host µs of each part of a no-grad sequence-parallel forward, ours and
PyTorch's sequential path, at a tiny shape where the time is all host work:
one process, rank 0 of a two-rank group of torch's "fake" backend (its
collectives move no data). Each case is timed back to back (2000 calls,
the GPU synchronised at the ends), over 3 rounds; the median is printed.

    python scripts/experiments/fwd_host_parts.py [--device cuda]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c import _C  # noqa: E402
from transformer_engine_c.benchmarks.mlp import all_gather_flat, reduce_scatter_flat  # noqa: E402
from transformer_engine_c.distributed import _all_gather_into, _reduce_scatter_into  # noqa: E402
from transformer_engine_c.module import _fast  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    pg = dist.group.WORLD
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dt = torch.bfloat16
    t, h, f = 2, 8, 16
    kw = dict(params_dtype=dt, device=dev, sequence_parallel=True, tp_size=2)
    row = tec.Linear(f, h, parallel_mode="row", bias=False, **kw)
    row_b = tec.Linear(f, h, parallel_mode="row", **kw)
    col = tec.LayerNormLinear(h, f, parallel_mode="column", bias=False, **kw)
    xr = torch.randn(2 * t, f // 2, dtype=dt, device=dev)
    x = torch.randn(t, h, dtype=dt, device=dev)
    w2 = row.weight.detach()
    w1, g1, b1 = col.weight.detach(), col.layer_norm_weight.detach(), col.layer_norm_bias.detach()
    part = torch.empty(2 * t, h, dtype=dt, device=dev)
    out = torch.empty(t, h, dtype=dt, device=dev)
    total = torch.empty(2 * t, h, dtype=dt, device=dev)
    ln = torch.empty(t, h, dtype=dt, device=dev)
    stats = torch.empty(2 * t, dtype=torch.float32, device=dev)
    placed = _fast._placed(xr, dt, (w2,))
    (_, d, ws, nbytes, stream), code = placed
    sp = stats.data_ptr()

    def seq_rs():
        torch.matmul(xr, w2.t(), out=part)
        reduce_scatter_flat(out, part, group=None)

    def seq_ag():
        all_gather_flat(total, F.layer_norm(x, (h,), g1, b1), group=None)
        return torch.matmul(total, w1.t())

    cases = {
        "row forward, no bias (ours)": lambda: row(xr),
        "row forward, bias (ours)": lambda: row_b(xr),
        "row .forward() (no nn.Module call)": lambda: row.forward(xr),
        "matmul + reduce_scatter (PyTorch)": seq_rs,
        "column LN forward, no bias (ours)": lambda: col(x),
        "layer_norm + all_gather + matmul (PyTorch)": seq_ag,
        "torch.matmul(out=)": lambda: torch.matmul(xr, w2.t(), out=part),
        "torch.matmul": lambda: torch.matmul(total, w1.t()),
        "_C.gemm": lambda: _C.gemm(d, code, code, 0, 1, 2 * t, h, f // 2, xr.data_ptr(), f // 2, w2.data_ptr(),
                                   f // 2, part.data_ptr(), h, 0, 0, 0, ws, nbytes, stream),
        "F.layer_norm": lambda: F.layer_norm(x, (h,), g1, b1),
        "_C.norm_fwd": lambda: _C.norm_fwd(d, code, t, h, x.data_ptr(), g1.data_ptr(), b1.data_ptr(), ln.data_ptr(),
                                           sp, sp + 4 * t, 1e-5, 0, stream),
        "reduce_scatter (torch.distributed)": lambda: reduce_scatter_flat(out, part, group=None),
        "_reduce_scatter_into (ours)": lambda: _reduce_scatter_into(out, part, pg),
        "pg._reduce_scatter_base().wait()": lambda: pg._reduce_scatter_base(out, part).wait(),
        "all_gather (torch.distributed)": lambda: all_gather_flat(total, x, group=None),
        "_all_gather_into (ours)": lambda: _all_gather_into(total, x, pg, False),
        "x.new_empty": lambda: x.new_empty(t, h),
        "torch.empty(device=)": lambda: torch.empty(t, h, dtype=dt, device=dev),
        "_fast._placed": lambda: _fast._placed(xr, dt, (w2, None)),
        "out.add_(bias)": lambda: out.add_(g1),
    }
    res = {k: [] for k in cases}
    with torch.no_grad():
        for rnd in range(4):
            for name, fn in cases.items():
                for _ in range(100):
                    fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                sync()
                if rnd:
                    res[name].append((time.perf_counter() - t0) / args.iters * 1e6)
    print(f"host µs per call, {dev}, bf16, {t} rows/rank, hidden {h}, ffn {f}, fake two-rank group; median of 3 rounds")
    for name, v in res.items():
        print(f"  {name:44s} {statistics.median(v):7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
