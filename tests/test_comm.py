"""Single-process communicator tests (tp_size 1): lifetime and leaks over 200
create/destroy cycles, shared-memory naming and permissions, buffer views,
closed-communicator errors and the ub_cfgs checks."""
import functools
import gc
import os
import re

import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c import _C
from transformer_engine_c.userbuffers import LAYER_NAMES

# These are tests of the shared-memory transport: keep them on the CPU also
# where a GPU would be the default device.
CommOverlapCPU = functools.partial(tec.CommOverlap, device="cpu")
initialize_ub_cpu = functools.partial(tec.initialize_ub, device="cpu")


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _shm():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("tec-"))


def _threads():
    return len(os.listdir("/proc/self/task"))


def _rss_kb():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def _cycle(i):
    c = CommOverlapCPU((64, 32), torch.float32, name=f"leak{i}")
    x, w = torch.randn(64, 32), torch.randn(16, 32)
    v = c.get_buffer(local_chunk=True)
    v.copy_(x)
    c.ag_gemm(v, w)
    c.gemm_rs(x, w)
    c.bulk_ag_start(x)
    c.bulk_ag_finish()
    del v
    c.close()


def test_create_destroy_200_no_leak():
    for i in range(5):  # warm up allocators and torch's lazy state
        _cycle(i)
    gc.collect()
    fds, shm, threads, rss = _fds(), _shm(), _threads(), _rss_kb()
    for i in range(200):
        _cycle(i)
    gc.collect()
    assert _fds() == fds, f"file descriptors: {fds} -> {_fds()}"
    assert set(_shm()) == set(shm), f"/dev/shm entries: {shm} -> {_shm()}"
    assert _threads() == threads, f"threads: {threads} -> {_threads()}"
    assert _rss_kb() - rss < 8 * 1024, f"RSS grew {rss} -> {_rss_kb()} kB"


def test_several_communicators_coexist():
    a = CommOverlapCPU((8, 4), torch.float32, name="a")
    b = CommOverlapCPU((8, 4), torch.float32, name="b")
    va = a.get_buffer()
    va.fill_(3.0)
    b.get_buffer().fill_(5.0)
    b.close()
    del b
    gc.collect()
    assert torch.all(va == 3.0) and torch.all(a.get_buffer() == 3.0)
    x, w = torch.randn(8, 4), torch.randn(2, 4)
    torch.testing.assert_close(a.ag_gemm(x, w), x @ w.T)
    a.close()


def _region_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tec-region"):
                out.append(int(fd))
        except OSError:  # closed since listed
            pass
    return out


def test_shm_regions_have_no_names():
    """Regions are memfds: nothing appears in /dev/shm, so nothing can be left
    there; each region's descriptor stays open until every rank has mapped it
    (release_handle), and the mapping outlives it."""
    before, fds = set(_shm()), set(_region_fds())
    objs = []
    for _ in range(2):
        c = _C.CommOverlap()
        c._create(_C.TRANSPORT_SHM, -1, 0, 1, 4096, "naming", 5.0)
        objs.append(c)
    assert set(_shm()) == before, sorted(set(_shm()) - before)
    assert len(set(_region_fds()) - fds) == 2, _region_fds()
    for c in objs:
        c._open_peers([c._local_handle()])
        c._release_handle()  # every rank has mapped it: the descriptor goes
    assert set(_region_fds()) == fds
    with open("/proc/self/maps") as f:
        assert f.read().count("/memfd:tec-region") >= 2
    for c in objs:
        c.close()


def test_shm_handle_of_another_file_is_refused():
    """A handle whose descriptor is not the region it names (here: the inode
    changed) is refused with an error naming the rank, not mapped."""
    a, b = _C.CommOverlap(), _C.CommOverlap()
    a._create(_C.TRANSPORT_SHM, -1, 0, 2, 4096, "mine", 5.0)
    b._create(_C.TRANSPORT_SHM, -1, 1, 2, 4096, "peer", 5.0)
    h = bytearray(b._local_handle())
    h[len(h) - 56 + 40] ^= 1  # the inode: the transport's 56 bytes (bytes, uid, pid, pid_ns, dev, ino, fd) end it
    with pytest.raises(ValueError, match="is not rank 1's region of"):
        a._open_peers([a._local_handle(), bytes(h)])
    a.close()
    b.close()


def test_buffer_views_and_ranges():
    c = CommOverlapCPU((8, 4), torch.bfloat16, name="views")
    full = c.get_buffer()
    assert full.shape == (8, 4) and full.dtype == torch.bfloat16
    (ptr, nbytes), = c.buffer_ranges()
    assert ptr == full.data_ptr() and nbytes >= 64
    t = torch.randn(8, 4).to(torch.bfloat16)
    c.copy_into_buffer(t)
    assert torch.equal(full, t)
    chunk = c.get_buffer(local_chunk=True)
    assert chunk.data_ptr() == full.data_ptr() and chunk.shape == (8, 4)
    with pytest.raises(ValueError, match="buffer too small for the input"):
        c.get_buffer(shape=(9, 4))
    # overlaps(): any byte in common with a buffer range, and nothing else
    assert c.overlaps(full) and c.overlaps(full[7:]) and c.overlaps(full.view(-1)[5:6])
    assert not c.overlaps(t) and not c.overlaps(full.clone()) and not c.overlaps(full[3:3])
    assert c._overlaps(ptr + nbytes - 1, ptr + nbytes) and c._overlaps(ptr - 8, ptr + 1)
    assert not c._overlaps(ptr + nbytes, ptr + nbytes + 64) and not c._overlaps(ptr - 64, ptr)
    c.close()
    full.fill_(1.0)  # still mapped while a view lives
    with pytest.raises(tec.EngineError, match="'views' is closed"):
        c.get_buffer()
    with pytest.raises(tec.EngineError, match="closed"):
        c.ag_gemm(t, t)
    assert c.buffer_ranges()  # the views pin the mapping past close()
    del full, chunk
    gc.collect()
    assert c.buffer_ranges() == []  # the last view gone: unmapped


def test_timeout_setting(monkeypatch):
    monkeypatch.setenv("TEC_COMM_TIMEOUT", "7.5")
    c = CommOverlapCPU((8, 4), torch.float32)
    assert c.timeout == 7.5
    assert re.fullmatch(r"comm\d+", c.name)
    c.close()
    monkeypatch.setenv("TEC_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TEC_COMM_TIMEOUT"):
        CommOverlapCPU((8, 4), torch.float32)


def test_registry_single_rank():
    initialize_ub_cpu((16, 8), 1, dtype=torch.float32, ub_cfgs={"fc1_fprop": {"method": "pipeline"}})
    try:
        assert tec.get_ub("fc1_fprop").method == "pipeline"
        assert tec.get_ub("qkv_fprop").method == "ring_exchange"
        with pytest.raises(RuntimeError, match="already"):
            initialize_ub_cpu((16, 8), 1)
    finally:
        tec.destroy_ub()
    with pytest.raises(RuntimeError, match="initialize_ub"):
        tec.get_ub("fc1_fprop")
    with pytest.raises(ValueError, match="'num_sms'"):
        initialize_ub_cpu((16, 8), 1, ub_cfgs={"fc1_fprop": {"num_sms": 4}})


def test_method_and_num_splits():
    """num_splits is None or the split the schedules use (tp_size); anything
    else raises naming it; stats() counts per schedule, all integers (so that
    counters of several communicators can be summed)."""
    for method in ("ring_exchange", "pipeline"):
        c = CommOverlapCPU((8, 4), torch.float32, method=method, num_splits=1)
        st = c.stats()
        assert c.method == method and c.num_splits == 1
        assert st["pull"] == st["push"] == 0 and all(type(v) is int for v in st.values()), st
        c.close()
        with pytest.raises(ValueError, match=rf"num_splits=4 is not supported for method='{method}'.*tp_size=1"):
            CommOverlapCPU((8, 4), torch.float32, method=method, num_splits=4)
    with pytest.raises(ValueError, match="num_splits=1 has no meaning for method='bulk'"):
        CommOverlapCPU((8, 4), torch.float32, method="bulk", num_splits=1)
    for bad in ("4", 2.0, True):
        with pytest.raises(ValueError, match="num_splits must be an int or None"):
            CommOverlapCPU((8, 4), torch.float32, num_splits=bad)
    with pytest.raises(ValueError, match="method must be one of"):
        CommOverlapCPU((8, 4), torch.float32, method="ring")


def test_ub_cfgs_keys():
    """TE's ub_cfgs: its knobs for its own comm kernels are accepted (documented
    no-ops, type-checked); those that would change what runs raise when set."""
    te_like = {"qkv_dgrad": {"method": "bulk", "num_sm": 2, "cga_size": 2, "set_sm_margin": 0},
               "qkv_fprop": {"method": "ring_exchange", "num_sm": 1, "set_sm_margin": 0, "atomic_gemm": 0,
                             "aggregate": 0, "use_ce": True, "num_splits": 1},
               "proj_fprop": {"method": "pipeline", "num_sm": 24, "cga_size": 2, "num_splits": 1,
                              "set_sm_margin": 1, "fp8_buf": 0, "comm_priority": -1, "gemm_priority": 0,
                              "is_reduce_scatter": True, "pipeline_rs_overlap_first_gemm": False}}
    initialize_ub_cpu((16, 8), 1, dtype=torch.float32, ub_cfgs=te_like)
    try:
        assert tec.get_ub("proj_fprop").method == "pipeline"
        assert tec.get_ub("qkv_dgrad").method == "bulk"
    finally:
        tec.destroy_ub()
    for cfg, msg in [({"aggregate": 1}, "'aggregate'.*not implemented"),
                     ({"pipeline_rs_overlap_first_gemm": True}, "pipeline_rs_overlap_first_gemm"),
                     ({"atomic_gemm": True}, "atomic GEMMs"), ({"fp8_buf": "yes"}, "'fp8_buf'.*bool"),
                     ({"use_ce": False}, "copy engines"), ({"use_ce": "no"}, "'use_ce'.*bool"), ({"num_sm": -1}, "'num_sm'.*>= 0"),
                     ({"cga_size": "2"}, "'cga_size'.*int"), ({"set_sm_margin": "yes"}, "'set_sm_margin'.*bool"),
                     ({"method": "pipeline", "num_splits": 4}, "num_splits=4")]:
        with pytest.raises(ValueError, match=msg):
            initialize_ub_cpu((16, 8), 1, ub_cfgs={"fc1_fprop": cfg})
    with pytest.raises(TypeError, match=r"ub_cfgs\['fc1_fprop'\] must be a dict"):
        initialize_ub_cpu((16, 8), 1, ub_cfgs={"fc1_fprop": ["method"]})


def test_ub_cfgs_fp8_buf_marks_the_row_layers_fp8_communicators():
    """fp8_buf, as TE honours it: the FP8 communicators of proj_fprop and
    fc2_fprop with the pipeline method send FP8 partials; the compute-dtype
    ones, other names and other methods do not."""
    cfgs = {"proj_fprop": {"method": "pipeline", "fp8_buf": True},
            "fc2_fprop": {"method": "ring_exchange", "fp8_buf": True},
            "fc1_dgrad": {"method": "pipeline", "fp8_buf": True}}
    mode = tec.module.base.UserBufferQuantizationMode
    initialize_ub_cpu((16, 8), 1, dtype=torch.float32, ub_cfgs=cfgs, quantization_modes=[mode.NONE, mode.FP8])
    try:
        marked = [c.name for fp8 in (False, True) for c in (tec.get_ub(n, fp8) for n in LAYER_NAMES) if c.fp8_buf]
        assert marked == ["proj_fprop_fp8"], marked
    finally:
        tec.destroy_ub()


def test_row_linear_ag_dgrad_with_one_rank():
    """tp_size 1: ag_gemm's buffer holds the gathered input afterwards, so a
    row layer's wgrad reads grad_output from it correctly."""
    c = CommOverlapCPU((8, 16), torch.float32, name="tp1row")
    try:
        torch.manual_seed(0)
        ub = tec.Linear(16, 12, device="cpu", parallel_mode="row", ub_overlap_ag=True, ub_overlap_rs=True, ub_comm=c)
        ref = tec.Linear(16, 12, device="cpu", parallel_mode="row")
        ref.load_state_dict(ub.state_dict())
        x = torch.randn(8, 16)
        dy = torch.randn(8, 12)
        for m in (ub, ref):
            xi = x.clone().requires_grad_()
            m(xi).backward(dy)
            m.dx = xi.grad
        torch.testing.assert_close(ub.dx, ref.dx)
        torch.testing.assert_close(ub.weight.grad, ref.weight.grad)
        torch.testing.assert_close(ub.bias.grad, ref.bias.grad)
    finally:
        c.close()


def test_dropping_a_communicator_with_a_pending_bulk_op():
    """The finalizer waits for the comm side before the pending input is freed."""
    c = CommOverlapCPU((1024, 1024), torch.float32, name="pending")
    c.bulk_rs_start(torch.randn(1024, 1024))
    del c
    gc.collect()


def test_linear_fed_a_buffer_view_saves_a_copy():
    """A column Linear whose input is the zero-copy local chunk of its own
    communicator saves a copy, not the buffer view."""
    c = CommOverlapCPU((8, 16), torch.float32, name="inbuf")
    try:
        m = tec.Linear(16, 12, device="cpu", parallel_mode="column", ub_overlap_ag=True, ub_comm=c)
        x = c.get_buffer(local_chunk=True)
        x.copy_(torch.randn(8, 16))
        w = m.weight.detach().clone().requires_grad_()
        with tec.debug.check_saved_tensors(c) as chk:
            y = m(x)
        assert chk.checked > 0 and not chk.violations
        torch.testing.assert_close(y, x @ w.t() + m.bias)
        del x
    finally:
        c.close()


def test_failed_backward_leaves_no_bulk_operation_pending():
    """An exception between bulk_ag_start and its finish (here: the wgrad GEMM
    fails) leaves the communicator usable."""
    c = CommOverlapCPU((8, 16), torch.float32, name="abandon")
    try:
        m = tec.Linear(16, 12, device="cpu", parallel_mode="column", ub_bulk_dgrad=True, ub_bulk_wgrad=True,
                       ub_comm={"dgrad": c, "wgrad": CommOverlapCPU((8, 16), torch.float32, name="abandon_w")})
        x = torch.randn(8, 16, requires_grad=True)
        y = m(x)
        from transformer_engine_c.module import _steps
        real = _steps._wgrad
        _steps._wgrad = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
        try:
            with pytest.raises(RuntimeError, match="injected"):
                y.sum().backward()
        finally:
            _steps._wgrad = real
        assert c._pending is None
        m(x).sum().backward()  # usable again
    finally:
        c.close()


def test_min_chunk_flops_settings(monkeypatch):
    """The small-shape fallback threshold: per device default, a number or
    {"ag", "rs"}, $TEC_UB_MIN_CHUNK_FLOPS; bad values are named errors."""
    c = CommOverlapCPU((8, 4), torch.float32, name="mcf")
    assert c.min_chunk_flops == {"ag": 0.0, "rs": 0.0}  # the CPU transport overlaps every size
    assert c.take_overlap("ag", 1, 1, 1) and c.stats()["ag_fallback"] == 0
    c.min_chunk_flops = {"ag": 3.0, "rs": 0.0}
    assert not c.take_overlap("ag", 1, 1, 1) and c.take_overlap("ag", 1, 1, 2)  # 2 FLOPs < 3 <= 4
    assert c.stats()["ag_fallback"] == 1 and c.stats()["rs_fallback"] == 0
    c.close()
    c = CommOverlapCPU((8, 4), torch.float32, name="mcf2", min_chunk_flops={"rs": 5})
    assert c.min_chunk_flops == {"ag": 0.0, "rs": 5.0}
    c.close()
    monkeypatch.setenv("TEC_UB_MIN_CHUNK_FLOPS", "1e9")
    c = CommOverlapCPU((8, 4), torch.float32, name="mcf3")
    assert c.min_chunk_flops == {"ag": 1e9, "rs": 1e9}
    c.close()
    for bad, word in ((-1, ">= 0"), ({"xx": 1}, "unknown key"), (float("nan"), ">= 0")):
        monkeypatch.delenv("TEC_UB_MIN_CHUNK_FLOPS")
        with pytest.raises(ValueError, match=word):
            CommOverlapCPU((8, 4), torch.float32, name="mcf4", min_chunk_flops=bad)
        monkeypatch.setenv("TEC_UB_MIN_CHUNK_FLOPS", "1e9")
    monkeypatch.setenv("TEC_UB_MIN_CHUNK_FLOPS", "lots")
    with pytest.raises(ValueError, match="TEC_UB_MIN_CHUNK_FLOPS"):
        CommOverlapCPU((8, 4), torch.float32, name="mcf5")


def test_gemm_sm_margin_settings(monkeypatch):
    """The SMs the chunk GEMMs leave free: 0 by default on the CPU (which has no
    SMs to leave), an argument or $TEC_UB_GEMM_SM_MARGIN, fixed at creation; bad
    values are named errors."""
    monkeypatch.delenv("TEC_UB_GEMM_SM_MARGIN", raising=False)
    c = CommOverlapCPU((8, 4), torch.float32, name="sm0")
    assert c.gemm_sm_margin == 0
    c.close()
    c = CommOverlapCPU((8, 4), torch.float32, name="sm1", gemm_sm_margin=4)
    assert c.gemm_sm_margin == 4
    c.close()
    monkeypatch.setenv("TEC_UB_GEMM_SM_MARGIN", "8")
    c = CommOverlapCPU((8, 4), torch.float32, name="sm2")
    assert c.gemm_sm_margin == 8
    with pytest.raises(AttributeError):
        c.gemm_sm_margin = 2  # fixed at creation: the engine has it
    c.close()
    for bad in (-1, 1.5, "4", True, float("inf")):
        with pytest.raises(ValueError, match="gemm_sm_margin must be an integer >= 0"):
            CommOverlapCPU((8, 4), torch.float32, name="sm3", gemm_sm_margin=bad)
    with pytest.raises(ValueError, match="gemm_sm_margin must be at most 65535"):
        CommOverlapCPU((8, 4), torch.float32, name="sm5", gemm_sm_margin=70000)
    for env in ("-3", "two", "1.5"):
        monkeypatch.setenv("TEC_UB_GEMM_SM_MARGIN", env)
        with pytest.raises(ValueError, match="TEC_UB_GEMM_SM_MARGIN must be an integer >= 0"):
            CommOverlapCPU((8, 4), torch.float32, name="sm4")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA GPU on this machine (the SM count is a GPU's)")
def test_gemm_sm_margin_below_the_sm_count():
    """On CUDA the margin must leave the GEMMs at least one SM; the default is 2."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match=f"below the {sms} SMs"):
        tec.CommOverlap((8, 4), torch.float32, device="cuda", name="smcuda", gemm_sm_margin=sms)


def test_a_dropped_communicator_is_freed():
    """A communicator dropped without close(), after its buffer was viewed
    and used, is freed once the views are gone: nothing it holds refers
    back to it (a cached buffer view once did, through the tensor storage)."""
    import weakref
    gc.collect()
    shm = _shm()
    c = CommOverlapCPU((64, 32), torch.float32, name="dropped")
    v = c.get_buffer(local_chunk=True)
    v.copy_(torch.randn(64, 32))
    c.ag_gemm(v, torch.randn(16, 32))
    c.bulk_ag_start(torch.randn(64, 32))
    c.bulk_ag_finish()
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is not None, "a live buffer view must keep its communicator"
    del v
    gc.collect()
    assert ref() is None, "the dropped communicator is still alive"
    assert set(_shm()) <= set(shm)


def test_take_overlap_checks_state_and_values():
    c = CommOverlapCPU((8, 4), torch.float32, name="mcf_state", min_chunk_flops=float("inf"))
    with pytest.raises(ValueError, match="must be >= 0"):
        c.min_chunk_flops = -5
    with pytest.raises(ValueError, match="unknown key"):
        c.min_chunk_flops = {"ag": 1, "bulk": 2}
    assert c.min_chunk_flops == {"ag": float("inf"), "rs": float("inf")}
    m = tec.Linear(4, 8, device="cpu", parallel_mode="column", ub_overlap_ag=True, ub_comm=c)
    m(torch.randn(8, 4))
    assert c.stats()["ag_fallback"] == 1
    c.close()
    # a closed communicator is an error on every path, also the fallback one
    with pytest.raises(tec.EngineError, match="closed"):
        c.take_overlap("ag", 1, 1, 1)
    with pytest.raises(tec.EngineError, match="closed"):
        m(torch.randn(8, 4))
