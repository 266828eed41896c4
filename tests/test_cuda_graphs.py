"""CUDA graphs of the layers (tec.make_graphed_callables, torch.cuda.graph):
forward and backward captured once and replayed 100 times with new inputs
give exactly the eager results (the same kernels on the same data); what
cannot be replayed (DistributedWeight) is refused at capture time, naming the
layer; TE's FP8 arguments are refused. Userbuffers operations capture (on
one rank here; two ranks: tests/distributed/test_graph_overlap.py), and a
bulk operation's start and finish must be captured together."""
import pytest
import torch

import transformer_engine_c as tec

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA GPU on this machine (CUDA graphs run on the GPU machines)")


def _layers(device, dtype):
    torch.manual_seed(0)
    return {
        "Linear": tec.Linear(64, 96, params_dtype=dtype, device=device),
        "LayerNormLinear": tec.LayerNormLinear(64, 96, params_dtype=dtype, device=device),
        "LayerNormMLP": tec.LayerNormMLP(64, 128, params_dtype=dtype, device=device),
    }


def test_fp8_and_unsupported_arguments_are_refused():
    m = tec.Linear(16, 8, device="cpu")
    x = (torch.randn(4, 16),)
    for kw, word in [({"fp8_enabled": True}, "FP8"), ({"fp8_weight_caching": True}, "FP8"),
                     ({"sample_kwargs": ({"is_first_microbatch": True},)}, "sample_kwargs"),
                     ({"_order": [1, -1]}, "_order"), ({"retain_graph_in_backward": True}, "retain_graph")]:
        with pytest.raises(NotImplementedError, match=word):
            tec.make_graphed_callables(m, x, **kw)


def test_distributed_weight_is_refused_before_capture():
    c = tec.CommOverlap((8, 16), torch.float32, device="cpu", name="graph_ub")
    try:  # userbuffers overlap is capturable: on the CPU only the missing GPU stops it
        m = torch.nn.Sequential(tec.Linear(16, 8, parallel_mode="column", ub_overlap_ag=True, ub_comm=c,
                                           device="cpu"))
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="needs a CUDA device"):
                tec.make_graphed_callables(m, (torch.randn(8, 16),))
    finally:
        c.close()
    m = tec.Linear(16, 8, device="cpu")
    m.weight = tec.DistributedWeight.from_full(m.weight.detach())
    with pytest.raises(RuntimeError, match="weight is a DistributedWeight"):
        tec.make_graphed_callables(m, (torch.randn(4, 16),))


@CUDA
@pytest.mark.parametrize("layer", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_graphed_layer_replays_as_eager(layer):
    device, dtype = torch.device("cuda"), torch.bfloat16
    eager = _layers(device, dtype)[layer]
    graphed_mod = _layers(device, dtype)[layer]  # same seed: the same parameters
    sample = torch.randn(32, 64, dtype=dtype, device=device, requires_grad=True)
    graphed = tec.make_graphed_callables(graphed_mod, (sample,))
    gen = torch.Generator(device=device).manual_seed(1)
    for step in range(100):
        x = torch.randn(32, 64, dtype=dtype, device=device, generator=gen)
        dy = torch.randn(32, 96 if layer != "LayerNormMLP" else 64, dtype=dtype, device=device, generator=gen)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        for m in (eager, graphed_mod):
            m.zero_grad(set_to_none=True)
        ye = eager(xe)
        ye.backward(dy)
        yg = graphed(xg)
        yg.backward(dy)
        torch.cuda.synchronize()
        assert torch.equal(yg, ye), (layer, step)
        assert torch.equal(xg.grad, xe.grad), (layer, step)
        for (n, pe), pg in zip(eager.named_parameters(), graphed_mod.parameters()):
            assert torch.equal(pg.grad, pe.grad), (layer, step, n)


@CUDA
def test_capture_refuses_distributed_weight_at_capture_time():
    m = tec.Linear(64, 96, params_dtype=torch.bfloat16, device="cuda")
    m.weight = tec.DistributedWeight.from_full(m.weight.detach())
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    m(x)  # eager works
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="Linear: a DistributedWeight .* cannot be captured in a CUDA graph"):
        with torch.cuda.graph(g):
            m(x)


@CUDA
def test_communicator_operations_replay_on_one_rank():
    """ag_gemm and gemm_rs captured under a plain torch.cuda.graph replay as
    eager (one rank: the schedules' copies and GEMMs, no handshakes)."""
    c = tec.CommOverlap((32, 64), torch.bfloat16, device="cuda", name="graph_ag")
    try:
        a = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
        w2 = torch.randn(64, 96, dtype=torch.bfloat16, device="cuda")
        c.ag_gemm(a, w)  # warm-up (GEMM plans) before the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = c.ag_gemm(a, w)
            z = c.gemm_rs(y, w2)
        for _ in range(10):
            a.copy_(torch.randn_like(a))
            g.replay()
            ye = c.ag_gemm(a, w)
            assert torch.equal(y, ye)
            assert torch.equal(z, c.gemm_rs(ye, w2))
    finally:
        torch.cuda.synchronize()
        c.close()


@CUDA
def test_bulk_start_and_finish_must_be_captured_together():
    c = tec.CommOverlap((32, 64), torch.bfloat16, device="cuda", name="graph_bulk")
    try:
        t = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
        c.bulk_ag_start(t)
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="graph_bulk': bulk_ag_finish inside the CUDA graph capture its "
                                               "bulk_ag_start was outside of"):
            with torch.cuda.graph(g):
                c.bulk_ag_finish()
        assert torch.equal(c.bulk_ag_finish(), t)  # still pending: finished outside, as started
    finally:
        torch.cuda.synchronize()
        c.close()
