"""CUDA graphs of userbuffers-overlapped layers on two ranks: a sequence-
parallel MLP block (LayerNormLinear column with AG+GEMM and GEMM+RS dgrad ->
gelu -> Linear row with GEMM+RS and AG+GEMM dgrad), a row Linear and a
LayerNormMLP with the bulk overlaps (bulk AG during dgrad, bulk RS during
wgrad), each captured with tec.make_graphed_callables over the same three
communicators, replayed (the block 100 times) with new data and compared bit
for bit with twins run eagerly on the same communicators in between (the
same kernels on the same data). The saved-tensor checker is active during the captures, and
must still catch a saved buffer view inside a capture. Run:
  torchrun --nproc_per_node=2 tests/distributed/run_graph_overlap.py
Rank r runs on cuda:(r % device_count): with one GPU both ranks share it (the
CUDA IPC transport works between processes on one device; the waits then
take turns with the other process). gloo exchanges the handles; every
collective of the layers goes through the communicators.
Prints "PASS run_graph_overlap" and exits 0 when every check passed."""
import os
import sys

import torch
import torch.distributed as dist

import transformer_engine_c as tec

SEQ, BATCH, HID, FFN = 32, 2, 128, 256  # SEQ: tokens per rank along the sequence
STEPS = 100


def block(seed, comms, kw):
    torch.manual_seed(seed)
    fc1 = tec.LayerNormLinear(HID, FFN, parallel_mode="column", ub_overlap_ag=True, ub_overlap_rs_dgrad=True,
                              ub_comm=comms, **kw)
    fc2 = tec.Linear(FFN, HID, parallel_mode="row", ub_overlap_rs=True, ub_overlap_ag=True, ub_comm=comms, **kw)
    return torch.nn.Sequential(fc1, torch.nn.GELU(approximate="tanh"), fc2)


def row(seed, comms, kw):
    torch.manual_seed(seed)
    return tec.Linear(FFN, HID, parallel_mode="row", ub_overlap_rs=True, ub_overlap_ag=True, ub_comm=comms, **kw)


def lnmlp(seed, comms, kw):
    torch.manual_seed(seed)
    names = {f"{part}_{role}": comms[role] for part, roles in (("fc1", ("fprop", "dgrad", "wgrad")),
                                                               ("fc2", ("fprop", "dgrad"))) for role in roles}
    return tec.LayerNormMLP(HID, FFN, set_parallel_mode=True, ub_overlap_ag=True, ub_overlap_rs=True,
                            ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_comm=names, **kw)


def step(fn, module, x, dy):
    """Forward + backward; (output, input grad, parameter grads)."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy)
    return [y.detach().clone(), x.grad] + [p.grad for p in module.parameters()]


def same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        if not torch.equal(g, w):
            d = (g.float() - w.float()).abs().max().item()
            raise AssertionError(f"{what}: tensor {i} differs from the eager twin (max abs diff {d:.3g})")


def checker_catches_a_saved_buffer_view(comm, dev):
    class SavesBuffer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(comm.get_buffer(shape=x.shape, dtype=x.dtype))
            return x * 2

        @staticmethod
        def backward(ctx, dy):
            return dy * 2

    x = torch.randn(4, HID, dtype=torch.bfloat16, device=dev, requires_grad=True)
    g = torch.cuda.CUDAGraph()
    try:
        with tec.debug.check_saved_tensors():
            with torch.cuda.graph(g):
                SavesBuffer.apply(x)
    except tec.debug.SavedTensorAliasError as e:
        assert comm.name in str(e), e
        return
    raise AssertionError("a buffer view saved inside a capture was not caught by the checker")


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dtype = torch.bfloat16
    comms = {role: tec.CommOverlap((SEQ * BATCH * size, FFN), dtype, tp_group=dist.group.WORLD, device=dev,
                                   name=f"graph_{role}", min_chunk_flops=0)
             for role in ("fprop", "dgrad", "wgrad")}
    kw = dict(params_dtype=dtype, device=dev, sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=size)
    mlp, mlp_eager = block(1, comms, kw), block(1, comms, kw)
    lin, lin_eager = row(2, comms, kw), row(2, comms, kw)
    mlp2, mlp2_eager = lnmlp(3, comms, kw), lnmlp(3, comms, kw)
    gen = torch.Generator(dev).manual_seed(10 + rank)

    def data(x_shape, dy_shape):
        return (torch.randn(x_shape, generator=gen, device=dev).to(dtype),
                torch.randn(dy_shape, generator=gen, device=dev).to(dtype) * 0.1)

    # The MLP block maps this rank's [SEQ, BATCH, HID] to the same; the row
    # Linear (half the tokens: another shape) [SEQ/2 * tp, BATCH, FFN/tp] to
    # [SEQ/2, BATCH, HID].
    mlp_io = ((SEQ, BATCH, HID), (SEQ, BATCH, HID))
    lin_io = ((SEQ // 2 * size, BATCH, FFN // size), (SEQ // 2, BATCH, HID))

    before = {n: c.stats() for n, c in comms.items()}
    with tec.debug.check_saved_tensors():  # the checker sees every tensor the captures save
        g_mlp = tec.make_graphed_callables(mlp, (data(*mlp_io)[0].requires_grad_(),))
        g_lin = tec.make_graphed_callables(lin, (data(*lin_io)[0].requires_grad_(),))
        g_mlp2 = tec.make_graphed_callables(mlp2, (data(*mlp_io)[0].requires_grad_(),))
    for i in range(STEPS):
        x, dy = data(*mlp_io)
        same(step(g_mlp, mlp, x, dy), step(mlp_eager, mlp_eager, x, dy), f"MLP block, replay {i}")
        if i % 3 == 0:  # a second graph on the same communicators, eager calls between its replays
            x, dy = data(*lin_io)
            a = step(g_lin, lin, x, dy)
            b = step(lin_eager, lin_eager, x, dy)
            c = step(g_lin, lin, x, dy)  # two replays back to back
            same(a, b, f"row Linear, replay {i}")
            same(c, b, f"row Linear, second replay {i}")
        if i % 4 == 1:
            x, dy = data(*mlp_io)
            same(step(g_mlp2, mlp2, x, dy), step(mlp2_eager, mlp2_eager, x, dy), f"LayerNormMLP bulk, replay {i}")
    for c in comms.values():
        c.synchronize()  # raises what a wait on a peer recorded
    after = {n: c.stats() for n, c in comms.items()}
    grew = {n: {k: after[n][k] - before[n][k] for k in ("ag_overlap", "rs_overlap")} for n in comms}
    # Replays run the captured operations without calling them: only the eager
    # twins and the captures' warm-up and capture calls count.
    assert grew["fprop"]["ag_overlap"] > 0 and grew["dgrad"]["rs_overlap"] > 0, grew
    bulk = {n: after[n][k] - before[n][k] for n, k in (("dgrad", "bulk_ag"), ("wgrad", "bulk_rs"))}
    assert bulk["dgrad"] > 0 and bulk["wgrad"] > 0, bulk
    checker_catches_a_saved_buffer_view(comms["fprop"], dev)
    torch.cuda.synchronize()
    for c in comms.values():
        c.close()
    dist.barrier()
    if rank == 0:
        print(f"graphs: {STEPS} replays of the MLP block, {2 * len(range(0, STEPS, 3))} of the row Linear and "
              f"{len(range(1, STEPS, 4))} of the bulk LayerNormMLP bit-identical to eager on {size} ranks sharing "
              f"{len(grew)} communicators")
        print("PASS run_graph_overlap")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
