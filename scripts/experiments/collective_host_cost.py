"""Host µs per call of a sequence-parallel collective through torch.distributed's
Python functions against the process group's own methods (what the Python
layer adds on top of the backend), one process, small tensors so the host is
the bound. With one rank NCCL still enqueues a kernel; the Python wrapper's
share is what a direct call could save. On CUDA the `raw` rows call NCCL's C
functions themselves (through ctypes, on a one-rank communicator of our own,
on the current stream): what a collective costs without ProcessGroupNCCL, the
price of an engine-owned communicator.

    python3 scripts/experiments/collective_host_cost.py [--backend nccl|gloo]
"""
import argparse
import ctypes
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


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def raw_nccl_rows(out, x):
    """NCCL's own entry points on a one-rank communicator of ours (the
    library torch loaded), enqueued on the current stream."""
    lib = ctypes.CDLL("libnccl.so.2")
    uid = _UniqueId()
    comm = ctypes.c_void_p()
    assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
    assert lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
    f32, total = 7, 0
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    xp, op_, n = ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(x.numel())
    ag, rs, ar = lib.ncclAllGather, lib.ncclReduceScatter, lib.ncclAllReduce
    ver = ctypes.c_int()
    return {
        "raw ncclAllGather (ctypes)": lambda: ag(xp, op_, n, f32, comm, stream),
        "raw ncclReduceScatter (ctypes)": lambda: rs(xp, op_, n, f32, total, comm, stream),
        "raw ncclAllReduce (ctypes)": lambda: ar(xp, xp, n, f32, total, comm, stream),
        "ctypes call, for scale": lambda: lib.ncclGetVersion(ctypes.byref(ver)),
    }


def layer_rows(pg, out, x):
    """What the layers call (transformer_engine_c.distributed), through the
    process group and through the engine's own communicator."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from transformer_engine_c import distributed as d

    def via(kind, fn):
        def run():
            d.set_collectives(kind)
            fn()
        return run
    rows = {}
    for kind in ("torch", "engine"):
        rows[f"layers' all-gather ({kind})"] = via(kind, lambda: d._all_gather_into(out, x, pg, False))
        rows[f"layers' async all-gather + wait ({kind})"] = via(
            kind, lambda: d._all_gather_into(out, x, pg, True).wait())
        rows[f"layers' reduce-scatter ({kind})"] = via(kind, lambda: d._reduce_scatter_into(out, x, pg))
    return rows


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
    if dev.type == "cuda":
        rows.update(raw_nccl_rows(out, x))
        rows.update(layer_rows(pg, out, x))
    for name, fn in rows.items():
        try:
            print(f"{name:32s} {per_call(fn, sync):8.2f} us")
        except Exception as e:  # a backend without the method
            print(f"{name:32s} n/a ({type(e).__name__}: {e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
