"""FP8 through a userbuffers communicator on one rank (the schedules' FP8
chunk GEMMs, CommOverlap's fp8= argument and its checks) and a layer's FP8
calls through a communicator given directly, on the CPU (FP8 emulated
exactly). The schedules on two ranks are tests/distributed/test_te_dropin.py's
FP8 overlap cases."""
import functools
import warnings

import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c import _fp8_engine as E
from transformer_engine_c._comm_overlap import FP8Gemm, FP8Partials

CommCPU = functools.partial(tec.CommOverlap, device="cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _q(t, fp8_dtype, scale):
    data, _, sinv = E.quantize(t.contiguous(), fp8_dtype, torch.tensor([scale]))
    return data, sinv


@pytest.fixture
def comm():
    c = CommCPU((64, 64), torch.bfloat16, name="fp8test")
    yield c
    c.close()


def test_ag_gemm_fp8_equals_the_fp8_gemm(comm):
    torch.manual_seed(0)
    x, w = torch.randn(32, 48), torch.randn(16, 48)
    bias = torch.randn(16).bfloat16()
    qx, sx = _q(x, E4M3, 4.0)
    qw, sw = _q(w, E4M3, 2.0)
    keep = torch.empty_like(qx)
    for fast in (False, True):
        y = comm.ag_gemm(qx, qw, bias=bias, local_copy=keep, fp8=FP8Gemm(E4M3, sx, E4M3, sw, torch.bfloat16, fast))
        want = E.fp8_gemm(qx, sx, E4M3, qw, sw, E4M3, out_dtype=torch.bfloat16, bias=bias,
                          use_split_accumulator=not fast)
        assert torch.equal(y, want)
        assert torch.equal(keep, qx)  # the local copy holds the FP8 bytes
        assert torch.equal(comm.get_buffer(shape=qx.shape, dtype=torch.uint8), qx)  # and so does the buffer
    # float32 output: the chunk GEMMs take a bfloat16 bias
    y = comm.ag_gemm(qx, qw, bias=bias, out_dtype=torch.float32, fp8=FP8Gemm(E4M3, sx, E4M3, sw, torch.float32))
    assert y.dtype is torch.float32
    assert torch.equal(y, E.fp8_gemm(qx, sx, E4M3, qw, sw, E4M3, out_dtype=torch.float32, bias=bias))


def test_gemm_rs_fp8_equals_the_fp8_gemm(comm):
    torch.manual_seed(1)
    dy, w = torch.randn(32, 16), torch.randn(16, 48)  # a dgrad: dY [32, 16] x W [16, 48]
    qdy, sdy = _q(dy, E5M2, 8.0)
    wt, sw = _q(w.t(), E4M3, 2.0)  # the weight's transpose [48, 16]: the [n, k] operand
    for dtype in (torch.bfloat16, torch.float32):
        bias = torch.randn(48, dtype=dtype)
        y = comm.gemm_rs(qdy, wt, bias=bias, fp8=FP8Gemm(E5M2, sdy, E4M3, sw, dtype))
        if dtype is torch.bfloat16:  # one rank: the bias in the GEMM's epilogue
            want = E.fp8_gemm(qdy, sdy, E5M2, wt, sw, E4M3, out_dtype=dtype, bias=bias)
        else:  # an FP8 GEMM takes no float32 bias: added afterwards
            want = E.fp8_gemm(qdy, sdy, E5M2, wt, sw, E4M3, out_dtype=dtype) + bias
        assert y.dtype is dtype and torch.equal(y, want)


def test_gemm_rs_fp8_partials_on_one_rank_write_the_output_directly(comm):
    """One rank has no partials to send: the GEMM writes the output in its
    dtype, exactly the plain FP8 GEMM's, and records no partial amax; the
    arguments are checked all the same (two ranks: tests/distributed,
    check_fp8_partials)."""
    torch.manual_seed(2)
    x, w = torch.randn(32, 48), torch.randn(16, 48)
    qx, sx = _q(x, E4M3, 4.0)
    qw, sw = _q(w, E4M3, 2.0)
    bias = torch.randn(16).bfloat16()
    amax = torch.zeros(1)
    one = torch.ones(1)
    f = FP8Gemm(E4M3, sx, E4M3, sw, torch.bfloat16)
    y = comm.gemm_rs(qx, qw, bias=bias, fp8=f, fp8_partials=FP8Partials(E4M3, one * 2, one / 2, amax))
    assert torch.equal(y, E.fp8_gemm(qx, sx, E4M3, qw, sw, E4M3, out_dtype=torch.bfloat16, bias=bias))
    assert amax.item() == 0.0
    with pytest.raises(TypeError, match="dtype must be torch.float8"):
        FP8Partials(torch.bfloat16, one, one)
    with pytest.raises(TypeError, match="scale_inv must be a float32 tensor of one element"):
        FP8Partials(E4M3, one, torch.ones(2))
    with pytest.raises(TypeError, match="amax must be a float32"):
        FP8Partials(E4M3, one, one, amax=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs FP8 chunk GEMMs"):
        comm.gemm_rs(x.bfloat16(), w.bfloat16(), fp8_partials=FP8Partials(E4M3, one, one))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        comm.gemm_rs(qx, qw, fp8=FP8Gemm(E4M3, sx, E4M3, sw, torch.float32), fp8_partials=FP8Partials(E4M3, one, one))
    with pytest.raises(TypeError, match="must be an FP8Partials"):
        comm.gemm_rs(qx, qw, fp8=f, fp8_partials=(E4M3, one, one))


def test_fp8_overlap_arguments_are_checked(comm):
    x8 = torch.zeros(32, 48, dtype=torch.uint8)
    w8 = torch.zeros(16, 48, dtype=torch.uint8)
    one = torch.ones(1)
    f = FP8Gemm(E4M3, one, E4M3, one)
    with pytest.raises(TypeError, match="a_dtype must be"):
        FP8Gemm(torch.bfloat16, one, E4M3, one)
    with pytest.raises(ValueError, match="both be torch.float8_e5m2"):
        FP8Gemm(E5M2, one, E5M2, one)
    with pytest.raises(TypeError, match="b_scale_inv must be a float32 tensor of one element"):
        FP8Gemm(E4M3, one, E4M3, torch.ones(2))
    with pytest.raises(TypeError, match="out_dtype"):
        FP8Gemm(E4M3, one, E4M3, one, torch.int32)
    with pytest.raises(ValueError, match="transb=True"):
        comm.ag_gemm(x8, w8.t().contiguous(), transb=False, fp8=f)
    with pytest.raises(TypeError, match="input has dtype torch.bfloat16; expected torch.uint8"):
        comm.ag_gemm(x8.bfloat16(), w8, fp8=f)
    with pytest.raises(TypeError, match="weight has dtype"):
        comm.gemm_rs(x8, w8.bfloat16(), fp8=f)
    with pytest.raises(TypeError, match="fp8 must be an FP8Gemm"):
        comm.ag_gemm(x8, w8, fp8=(E4M3, one))
    with pytest.raises(TypeError, match="bias has dtype"):
        comm.ag_gemm(x8, w8, bias=torch.zeros(16, dtype=torch.float16), fp8=f)
    # and uint8 is still refused without fp8
    with pytest.raises(TypeError, match="expected float32, bfloat16 or float16"):
        comm.ag_gemm(x8, w8)
    # the communicator is still usable after the refusals
    y = comm.ag_gemm(x8, w8, fp8=f)
    assert y.shape == (32, 16) and y.abs().sum() == 0


def _layer(cls, comm, **kw):
    torch.manual_seed(5)
    return cls(64, 64, device="cpu", params_dtype=torch.float32, tp_size=1, ub_comm=comm, **kw)


@pytest.mark.parametrize("recipe", [tec.recipe.DelayedScaling, tec.recipe.Float8CurrentScaling])
@pytest.mark.parametrize("case", ["row", "column", "column_rs_dgrad", "lnl_column"])
def test_fp8_layer_through_a_communicator_equals_plain(case, recipe):
    """One rank, the communicator given directly: the overlap paths run (in
    FP8) and give the plain FP8 path's values, step after step."""
    mode = "row" if case == "row" else "column"
    flags = dict(ub_overlap_rs=True) if mode == "row" else (
        dict(ub_overlap_ag=True, ub_overlap_rs_dgrad=True) if case == "column_rs_dgrad" else
        dict(ub_overlap_ag=True, ub_bulk_dgrad=True))
    cls = tec.LayerNormLinear if case.startswith("lnl") else tec.Linear
    comms = {r: CommCPU((32, 64), torch.float32, name=f"{case}{r}") for r in ("fprop", "dgrad", "wgrad")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ub = _layer(cls, comms, parallel_mode=mode, **flags)
            ref = _layer(cls, None, parallel_mode=mode)
        ref.load_state_dict(ub.state_dict())
        before = {r: dict(c.stats()) for r, c in comms.items()}
        for step in range(3):
            x = torch.randn(32, 64) * (1 + step)
            got = []
            for m in (ub, ref):
                xi = x.clone().requires_grad_()
                with tec.autocast(recipe=recipe()):
                    y = m(xi)
                y.backward(torch.randn(32, 64, generator=torch.Generator().manual_seed(step)))
                got.append([y, xi.grad] + [p.grad for p in m.parameters()])
            for a, b in zip(*got):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        ran = sum(c.stats()[k] - before[r][k] for r, c in comms.items() for k in ("non_overlap", "ag_overlap",
                                                                                 "rs_overlap", "bulk_ag"))
        assert ran >= 3, "the communicator's schedules did not run"
    finally:
        for c in comms.values():
            c.close()


def test_block_scaling_runs_the_plain_collectives_with_one_warning():
    comms = {r: CommCPU((32, 64), torch.float32, name=f"blk{r}") for r in ("fprop", "dgrad", "wgrad")}
    try:
        m = _layer(tec.Linear, comms, parallel_mode="column", ub_overlap_ag=True, ub_bulk_dgrad=True)
        before = dict(comms["fprop"].stats())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with tec.autocast(recipe=tec.recipe.Float8BlockScaling()):
                    m(torch.randn(32, 64, requires_grad=True)).sum().backward()
        msgs = [str(w.message) for w in caught if "Float8BlockScaling" in str(w.message)]
        assert len(msgs) == 1 and "plain collectives" in msgs[0]
        assert comms["fprop"].stats()["non_overlap"] == before["non_overlap"]
    finally:
        for c in comms.values():
            c.close()


@pytest.mark.parametrize("recipe", [tec.recipe.DelayedScaling, tec.recipe.Float8CurrentScaling])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_fp8_layernorm_mlp_through_communicators_equals_plain(recipe, checkpoint):
    """LayerNormMLP's four overlaps (fc1's input all-gather and bulk dgrad,
    fc2's reduce-scatter and dY all-gather) in FP8 on one rank, with and
    without recomputation, against the plain FP8 path."""
    names = ("fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad")
    comms = {n: CommCPU((32, 64), torch.float32, name=f"mlp{n}{checkpoint}") for n in names}
    try:
        def build(ub):
            torch.manual_seed(7)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return tec.LayerNormMLP(64, 128, device="cpu", params_dtype=torch.float32, tp_size=1,
                                        set_parallel_mode=True, checkpoint=checkpoint, ub_comm=ub,
                                        ub_overlap_ag=ub is not None, ub_overlap_rs=ub is not None,
                                        ub_bulk_dgrad=ub is not None, ub_bulk_wgrad=ub is not None)
        ub, ref = build(comms), build(None)
        before = sum(c.stats()["non_overlap"] + c.stats()["bulk_ag"] for c in comms.values())
        for step in range(3):
            x = torch.randn(32, 64) * (1 + step)
            dy = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
            got = []
            for m in (ub, ref):
                xi = x.clone().requires_grad_()
                with tec.autocast(recipe=recipe()):
                    y = m(xi)
                y.backward(dy)
                got.append([y, xi.grad] + [p.grad for p in m.parameters()])
            for a, b in zip(*got):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        after = sum(c.stats()["non_overlap"] + c.stats()["bulk_ag"] for c in comms.values())
        assert after - before >= 9, "the communicators' schedules did not run"
    finally:
        for c in comms.values():
            c.close()
