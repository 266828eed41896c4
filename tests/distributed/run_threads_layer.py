"""Two threads on every rank sharing one overlapped LayerNormLinear (column,
sequence parallel, ub_overlap_ag), each thread with inputs of its own on
every rank, so a call paired with the other thread's call on a peer gives a
wrong output.

* "turns": the threads take turns, one call each, in the same order on every
  rank: every output is right (the layer holds its communicator across the
  norm-into-the-slot + ag_gemm sequence).
* "at-once": both threads call at the same time. A thread that finds the
  communicator in use is refused, the communicator then refuses everything
  on that rank, and the peers' next waits on that rank time out naming it.
  Every thread that returned a wrong output must have raised afterwards,
  every rank must raise, and every error must be one of those two.

Prints "PASS run_threads_layer <mode>".
    torchrun --nproc_per_node=2 tests/distributed/run_threads_layer.py turns|at-once
"""
import sys
import threading

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank

SEQ, HID, OUT, ITERS = 8, 32, 24, 30
REFUSED = "called it while thread"
PEER_TIMEOUT = "timed out"


class Turns:
    """Threads 0..n-1 take turns, one call each in a round."""

    def __init__(self, n):
        self.cv, self.turn, self.n = threading.Condition(), 0, n

    def take(self, t, fn):
        with self.cv:
            if not self.cv.wait_for(lambda: self.turn == t, timeout=120):
                raise TimeoutError(f"thread {t} waited 120 s for its turn")
        try:
            return fn()
        finally:
            with self.cv:
                self.turn = (t + 1) % self.n
                self.cv.notify_all()


def main():
    mode = sys.argv[1]
    rank, tp, _ = init_rank("cpu")
    torch.manual_seed(0)
    tec.initialize_ub((SEQ * tp, HID), tp, dtype=torch.float32, tp_group=dist.group.WORLD, min_chunk_flops=0,
                      timeout=5 if mode == "at-once" else 30)
    layer = tec.LayerNormLinear(HID, OUT, parallel_mode="column", sequence_parallel=True, tp_group=dist.group.WORLD,
                                ub_overlap_ag=True, ub_name="qkv", params_dtype=torch.float32)
    torch.manual_seed(100 + rank)
    xs = [torch.randn(SEQ, HID) for _ in range(2)]
    want = []
    with torch.no_grad():
        for x in xs:  # without overlap: the layer on every rank's input of the same thread
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x)
            ln = torch.nn.functional.layer_norm(torch.cat(parts), (HID,), layer.layer_norm_weight,
                                                layer.layer_norm_bias, layer.eps)
            want.append(ln @ layer.weight.t() + layer.bias)
    results = [[], []]  # per thread: True (right) / False (wrong) per returned call
    errors = [None, None]
    turns, start = Turns(2), threading.Barrier(2)

    def call(t):
        with torch.no_grad():
            return layer(xs[t])

    def worker(t):
        try:
            start.wait()
            for _ in range(ITERS):
                y = turns.take(t, lambda: call(t)) if mode == "turns" else call(t)
                results[t].append(torch.allclose(y, want[t], rtol=1e-4, atol=1e-4))
        except Exception as e:  # noqa: BLE001 - judged below
            errors[t] = f"{type(e).__name__}: {e}"

    ths = [threading.Thread(target=worker, args=(t,), name=f"worker{t}") for t in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    print(f"rank {rank} {mode}: right per thread {[sum(r) for r in results]}, wrong "
          f"{[len(r) - sum(r) for r in results]}, errors {[e and e[:160] for e in errors]}", flush=True)
    if mode == "turns":
        assert errors == [None, None], f"rank {rank}: {errors}"
        assert all(len(r) == ITERS and all(r) for r in results), f"rank {rank}: wrong outputs {results}"
    else:
        assert any(errors), f"rank {rank}: both threads ran {ITERS} calls at once and nothing was refused"
        for t in range(2):
            assert errors[t] is not None or all(results[t]), \
                f"rank {rank} thread {t}: a wrong output and no error afterwards: {results[t]}"
            assert errors[t] is None or REFUSED in errors[t] or PEER_TIMEOUT in errors[t], \
                f"rank {rank} thread {t}: an unexpected error: {errors[t]}"
            if errors[t] and REFUSED in errors[t]:
                assert "'qkv_fprop'" in errors[t] and "worker0" in errors[t] and "worker1" in errors[t], errors[t]
    dist.barrier()
    tec.destroy_ub()  # a refused communicator still closes
    dist.barrier()
    dist.destroy_process_group()
    print(f"PASS run_threads_layer {mode}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
