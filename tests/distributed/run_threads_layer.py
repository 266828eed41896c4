"""Two threads sharing an overlapped LayerNormLinear (column, sequence
parallel, ub_overlap_ag) on every rank. Rank 1's threads use the
same input, rank 0's threads different ones: however the ranks' calls pair
up, rank 0's output for its thread t must be the layer of [x0_t; x1]. A
layer that lets another thread write the communicator's slot between its
norm and its ag_gemm gives some wrong outputs on rank 0. Prints
"PASS run_threads_layer" (needs the layers to hold comm.exclusive() around
the norm-into-buffer + ag_gemm sequence).

    torchrun --nproc_per_node=2 tests/distributed/run_threads_layer.py
"""
import sys
import threading

import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank

SEQ, HID, OUT, ITERS = 8, 32, 24, 60


def main():
    rank, tp, _ = init_rank("cpu")
    torch.manual_seed(0)
    tec.initialize_ub((SEQ * tp, HID), tp, dtype=torch.float32, tp_group=dist.group.WORLD, min_chunk_flops=0,
                      timeout=30)
    layer = tec.LayerNormLinear(HID, OUT, parallel_mode="column", sequence_parallel=True, tp_group=dist.group.WORLD,
                                ub_overlap_ag=True, ub_name="qkv", params_dtype=torch.float32)
    xs = [torch.randn(SEQ, HID) for _ in range(2)]
    if rank:
        xs[1] = xs[0]
    x1 = xs[0].clone()
    dist.broadcast(x1, 1)  # rank 1's input, known to rank 0
    with torch.no_grad():
        want = []
        for x in xs:  # reference without overlap: the layer on the gathered input
            full = torch.cat([x, x1]) if rank == 0 else None
            if full is not None:
                ln = torch.nn.functional.layer_norm(full, (HID,), layer.layer_norm_weight, layer.layer_norm_bias,
                                                    layer.eps)
                want.append(ln @ layer.weight.t() + layer.bias)
    wrong, errors = [0, 0], []

    def worker(t):
        try:
            for _ in range(ITERS):
                with torch.no_grad():
                    y = layer(xs[t])
                if rank == 0 and not torch.allclose(y, want[t], rtol=1e-4, atol=1e-4):
                    wrong[t] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    ths = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors, f"rank {rank}: {errors}"
    assert wrong == [0, 0], f"rank {rank}: wrong outputs per thread {wrong} of {ITERS}"
    dist.barrier()
    tec.destroy_ub()
    dist.destroy_process_group()
    if rank == 0:
        print("PASS run_threads_layer", flush=True)


if __name__ == "__main__":
    sys.exit(main())
