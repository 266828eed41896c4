"""Exit with a gloo process group still referenced from a reference cycle
through a communicator (as layers and communicators hold their tp_group),
after a collective issued inside a saved-tensor-hooks context whose work
finishes late: the group must be released before the interpreter finalizes
(transformer_engine_c's atexit), or gloo's worker drops the finished work
during finalization and the process aborts ("terminate called without an
active exception"). Prints "PASS run_exit_order" on rank 0; the test checks
every rank's exit status."""
import sys
import time

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank


class Holder:
    pass


def main():
    rank, tp, _ = init_rank("cpu")
    comm = tec.CommOverlap((tp * 4, 8), torch.float32, tp_group=dist.group.WORLD, timeout=20, name="exitorder")
    h = Holder()
    h.comm, h.self = comm, h  # a cycle: only the garbage collector frees it (and with it the group)
    comm.holder = h
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with hooks:
        if rank == 1:
            time.sleep(1.0)  # rank 0's barrier work finishes late, in gloo's worker thread
        dist.barrier(async_op=True)
    if rank == 0:
        print("PASS run_exit_order", flush=True)
    dist.destroy_process_group()
    del comm, h


if __name__ == "__main__":
    sys.exit(main())
