"""A/A and order controls for a benchmark row (a diagnostic, not a test).

Run under torchrun on the GPU machine:
    torchrun --nproc_per_node=2 scripts/experiments/order_control.py [TxHxN] [iters]
Times the MLP forward+backward step (as the benchmark's mlp row) with the
benchmark's Timer (whose rounds shuffle the order, so each comparison is
also an order control): two identical plain-layer steps against each other
(A/A: the noise floor), and the plain step against the overlapped layers'
step, each repeated. At a shape where the overlapped layers fall back, the two
run the same GPU work, so any difference beyond the A/A spread is host
cost or position.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank
from transformer_engine_c.benchmarks.overlap import Timer, _ub_layers


def main():
    rank, size, device = init_rank("cuda" if torch.cuda.is_available() else "cpu")
    group = dist.new_group(list(range(size)))
    T, H, N = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2048x2048x6144").split("x"))
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(T // size, H, dtype=dtype, device=device, generator=g).requires_grad_()
    dy = torch.randn(T // size, H, dtype=dtype, device=device, generator=g)

    def make(overlap):
        fc1, fc2 = _ub_layers(tec, "mlp", size, group, T, H, N, dtype, device, overlap)

        def step():
            fc2(F.gelu(fc1(x))).backward(dy)
        return step
    plain1, plain2, ub = make(False), make(False), make(True)
    timer = Timer(device, group, 10, iters, 4)
    for label, fns in (("A/A", {"plain1": plain1, "plain2": plain2}),
                       ("plain vs overlap", {"plain": plain1, "overlap layers": ub}),
                       ("A/A again", {"plain2": plain2, "plain1": plain1}),
                       ("plain vs overlap again", {"overlap layers": ub, "plain": plain1})):
        r = timer.many(fns)
        if len(r) < 2:
            raise SystemExit(f"{label}: only {list(r)} ran")
        a, b = list(r)
        if rank == 0:
            print(f"{label:22s} " + "  ".join(f"{k} {v:.3f} ms" for k, v in r.items())
                  + f"   {a} / {b} = {r[a] / r[b]:.3f}", flush=True)
    tec.destroy_ub()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
