"""How the layers turn their `weight` parameter into the tensor a GEMM uses,
and route the GEMM's weight gradient back. A plain tensor is used as is; a
DistributedWeight (is_distributed_weight = True) is materialised on demand
(forward, and again in backward) and reduces its own gradient."""


def weight_for_compute(w):
    return w


def weight_grad(w, dw_full):
    return dw_full
