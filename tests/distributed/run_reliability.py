"""Misuse on a multi-rank communicator is refused before any state change:
every rank makes the same refused call, then a valid call must
still give the right answer on every rank (no epoch was taken, no peer
waits). Also buffer_ranges() after unmapping, and two threads sharing one
communicator. Prints "PASS run_reliability".

    torchrun --nproc_per_node=2 tests/distributed/run_reliability.py
"""
import re
import sys
import threading
import time

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank
from run_threads_layer import Turns

ROWS, K, N = 4, 8, 6


def refused(fn, pattern, exc=ValueError):
    try:
        fn()
    except exc as e:
        assert re.search(pattern, str(e)), f"message {str(e)!r} does not match {pattern!r}"
        return
    raise AssertionError(f"accepted; expected {exc.__name__} matching {pattern!r}")


def gathered(a_local, tp):
    parts = [torch.empty_like(a_local) for _ in range(tp)]
    dist.all_gather(parts, a_local)
    return torch.cat(parts)


def check_usable(comm, tp, seed):
    """A valid ag_gemm on every rank gives all_gather(a) @ w.T."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    a = torch.randn(ROWS, K, generator=g) + dist.get_rank()
    y = comm.ag_gemm(a, w)
    torch.testing.assert_close(y, gathered(a, tp) @ w.t(), rtol=1e-5, atol=1e-5)


def main():
    rank, tp, _ = init_rank("cpu")
    comm = tec.CommOverlap((ROWS * tp, K), torch.float32, tp_group=dist.group.WORLD, min_chunk_flops=0,
                           timeout=20, name="rel")
    w = torch.randn(N, K)
    a = torch.randn(ROWS, K)
    check_usable(comm, tp, 0)

    # 1. out_dtype refused before the epoch; 2. out in the buffer refused.
    refused(lambda: comm.ag_gemm(a, w, out_dtype=torch.float16), "out_dtype must be the input's dtype")
    check_usable(comm, tp, 1)
    buf = comm.get_buffer(shape=(ROWS * tp, N))
    refused(lambda: comm.ag_gemm(a, w, out=buf), "out lies in a communicator buffer")
    refused(lambda: comm.ag_gemm(a, w, out=torch.empty(ROWS * tp, N, dtype=torch.float16)), "out has dtype")
    other = comm.get_buffer(shape=(ROWS, K))  # rank 0's slot: not this rank's chunk on rank >= 1
    if rank:
        refused(lambda: comm.ag_gemm(other, w), "a_local lies in a communicator buffer but is not")
    check_usable(comm, tp, 2)
    # The raw entry point refuses the dtype mismatch before the epoch, too.
    out = torch.empty(ROWS * tp, N, dtype=torch.float16)
    refused(lambda: comm._ag_gemm(a.data_ptr(), ROWS, K, N, 0, 2, w.data_ptr(), K, 1, out.data_ptr(), N, 0, 0, 0, -1, -1, 0, 0, 0),
            "out_dtype must be the input's dtype or float32")
    check_usable(comm, tp, 3)

    # 3. bulk_ag_start of a 0-d tensor: refused before the C side starts.
    refused(lambda: comm.bulk_ag_start(torch.tensor(1.0)), "at least one dimension")
    t = torch.full((ROWS, K), float(rank))
    comm.bulk_ag_start(t)
    g = comm.bulk_ag_finish()
    torch.testing.assert_close(g, gathered(t, tp))
    check_usable(comm, tp, 4)

    # 5. Threads. Raw entry point: a second engine call while one runs (here
    # blocked waiting for rank 1, which arrives late) is refused clearly.
    dist.barrier()
    if rank == 0:
        outs = {}
        y = torch.empty(ROWS * tp, N)
        blocker = threading.Thread(target=lambda: outs.setdefault("a", comm.ag_gemm(a, w, out=y)))
        blocker.start()
        deadline = time.time() + 10
        seen = None
        while time.time() < deadline and seen is None:
            try:
                tec._C.CommOverlap._synchronize(comm, 0)
            except tec.EngineError as e:
                seen = str(e)
            time.sleep(0.01)
        dist.barrier()  # let rank 1 arrive
        blocker.join()
        assert seen and "in use by another thread" in seen, seen
    else:
        dist.barrier()
        comm.ag_gemm(a, w)
    check_usable(comm, tp, 5)
    # Two threads sharing the communicator through the Python class, taking
    # turns in the same order on every rank (run_threads_layer.py: at once,
    # they are refused).
    g = torch.Generator().manual_seed(7)
    wt = torch.randn(N, K, generator=g)
    at = torch.randn(ROWS, K, generator=g) + rank
    want = gathered(at, tp) @ wt.t()
    bad, errors = [], []
    turns = Turns(2)

    def worker(t):
        try:
            for _ in range(40):
                yy = turns.take(t, lambda: comm.ag_gemm(at, wt))
                if not torch.allclose(yy, want, rtol=1e-5, atol=1e-5):
                    bad.append(1)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    ths = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t_ in ths:
        t_.start()
    for t_ in ths:
        t_.join()
    assert not errors and not bad, f"rank {rank}: {len(bad)} wrong outputs, errors {errors}"
    check_usable(comm, tp, 6)

    # 4. buffer_ranges after unmapping the peers: own region only, never garbage.
    before = comm.buffer_ranges()
    assert len(before) == tp and before[0][0] == comm.buffer_ptr, before
    dist.barrier()
    comm._unmap_peers(0)
    after = comm.buffer_ranges()
    assert after == before[:1], f"rank {rank}: after unmap {after}, own region {before[:1]}"
    dist.barrier()
    comm.close()
    assert comm.buffer_ranges() == [] or comm.buffer_ranges() == before[:1]

    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("PASS run_reliability", flush=True)


if __name__ == "__main__":
    sys.exit(main())
