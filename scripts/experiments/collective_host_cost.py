"""Host µs per call of a sequence-parallel collective through torch.distributed's
Python functions against the process group's own methods (what the Python
layer adds on top of the backend), one process, small tensors so the host is
the bound. With one rank NCCL still enqueues a kernel; the Python wrapper's
share is what a direct call could save.

    python3 scripts/experiments/collective_host_cost.py [--backend nccl|gloo]
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def per_call(fn, sync, n=300, reps=7):
    for _ in range(30):
        fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        sync()
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dev = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    pg = dist.distributed_c10d._get_default_group()
    x = torch.randn(16, 64, device=dev)
    out = torch.empty(16, 64, device=dev)
    rows = {
        "dist.all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "pg._allgather_base": lambda: pg._allgather_base(out, x),
        "dist.reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, x),
        "pg._reduce_scatter_base": lambda: pg._reduce_scatter_base(out, x),
        "dist.all_reduce": lambda: dist.all_reduce(x),
        "pg.allreduce([x])": lambda: pg.allreduce([x]),
        "torch.empty (for scale)": lambda: torch.empty(16, 64, device=dev),
    }
    for name, fn in rows.items():
        try:
            print(f"{name:32s} {per_call(fn, sync):8.2f} us")
        except Exception as e:  # a backend without the method
            print(f"{name:32s} n/a ({type(e).__name__}: {e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
