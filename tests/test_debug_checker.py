"""tec.debug.check_saved_tensors: every saved tensor whose memory overlaps a
communicator buffer is caught (negative tests), nothing else is flagged
(positive tests), on CPU and, where present, on CUDA. Communicators are
stand-ins exposing ranges of plain torch tensors (the protocol the
userbuffers' CommOverlap implements); a test with the real CommOverlap runs
when it exists."""
import gc
import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint as ckpt

import transformer_engine_c as tec
from transformer_engine_c import _C, debug
from transformer_engine_c._saved import prepare_for_saving, restore_from_saved
from transformer_engine_c.debug import SavedTensorAliasError, SavedTensorAliasWarning


class FakeComm:
    """A communicator stand-in: own buffer first, then peers' mapped buffers."""

    def __init__(self, name, *buffers):
        self.name, self.buffers = name, list(buffers)

    def buffer_ranges(self):
        return [(b.data_ptr(), b.untyped_storage().nbytes()) if isinstance(b, torch.Tensor) else b
                for b in self.buffers]

    def get_buffer(self):
        return self.buffers[0]


class SaveInput(torch.autograd.Function):
    """A layer-like Function that saves its input as is: wrong when the input
    is a get_buffer() view."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum_to_size(w.shape)


class SaveThroughPrepare(torch.autograd.Function):
    """Saves like our layers do: prepare_for_saving, then save_for_backward."""

    @staticmethod
    def forward(ctx, x, w):
        saved, ctx.objects = prepare_for_saving(x, w)
        ctx.save_for_backward(*saved)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = restore_from_saved(ctx.objects, ctx.saved_tensors)
        return g * w, (g * x).sum_to_size(w.shape)


@pytest.fixture
def comm(device):
    c = FakeComm("ub_ag", torch.zeros(64, 16, device=device), torch.zeros(64, 16, device=device))
    debug.register_comm(c)
    yield c
    debug.unregister_comm(c)


def _w(device, n=16):
    return torch.randn(n, device=device, requires_grad=True)


# ------------------------------------------------------------- the C range test

def test_find_overlap_edges():
    f = _C.find_overlap
    table = (100, 200, 200, 250, 300, 400)     # disjoint, touching allowed
    assert f(0, 100, table) == -1              # ends exactly at the first start
    assert f(0, 101, table) == 0
    assert f(199, 200, table) == 0
    assert f(200, 201, table) == 1
    assert f(250, 300, table) == -1            # the gap, both ends exclusive
    assert f(249, 301, table) == 1             # first of several overlapped
    assert f(399, 400, table) == 2
    assert f(400, 500, table) == -1
    assert f(150, 150, table) == -1            # empty query
    assert f(0, 1 << 63, ()) == -1
    assert f((1 << 64) - 2, (1 << 64) - 1, (0, 5, (1 << 64) - 10, (1 << 64) - 1)) == 1


def test_find_overlap_many_ranges():
    table = tuple(v for i in range(1000) for v in (10 * i, 10 * i + 5))
    for q in range(0, 10000, 7):
        want = next((i for i in range(1000) if 10 * i < q + 3 and q < 10 * i + 5), -1)
        assert _C.find_overlap(q, q + 3, table) == want


def test_find_overlap_bad_arguments():
    with pytest.raises(TypeError, match="3 positional"):
        _C.find_overlap(0, 1)
    with pytest.raises(TypeError, match="tuple"):
        _C.find_overlap(0, 1, [0, 1])
    with pytest.raises(ValueError, match="pairs"):
        _C.find_overlap(0, 1, (0, 1, 2))
    with pytest.raises(TypeError):
        _C.find_overlap(-1, 1, ())
    with pytest.raises(TypeError, match="bound"):
        _C.find_overlap(0, 10, (0, "x"))


# ------------------------------------------------------------- negative tests

def test_function_saving_buffer_view_is_caught(device, comm):
    buf = comm.get_buffer()
    w = _w(device)
    with pytest.raises(SavedTensorAliasError) as ei:
        with debug.check_saved_tensors():
            SaveInput.apply(buf[:8], w)
    msg = str(ei.value)
    assert "(8, 16)" in msg and "torch.float32" in msg
    assert "'ub_ag'" in msg and "buffer range 0" in msg
    assert "SaveInput (autograd.Function)" in msg
    assert "SaveInput.apply(buf[:8], w)" in msg          # the source line that saved it
    v = ei.value.violation
    assert v.shape == (8, 16) and v.dtype == torch.float32 and v.comm == "ub_ag" and not v.during_backward


def test_prepare_for_saving_path_is_caught(device, comm):
    """Our layers save through prepare_for_saving + ctx.save_for_backward; the
    saved-tensor hook sees what save_for_backward receives."""
    buf = comm.get_buffer()
    with pytest.raises(SavedTensorAliasError, match="SaveThroughPrepare"):
        with debug.check_saved_tensors():
            SaveThroughPrepare.apply(buf[8:16], _w(device))


def test_plain_op_saving_buffer_view_is_caught(device, comm):
    buf = comm.get_buffer()
    w = _w(device)
    with pytest.raises(SavedTensorAliasError) as ei:
        with debug.check_saved_tensors():
            torch.mul(buf[:4], w)          # mul saves self because w requires grad
    assert "an autograd op" in str(ei.value) and "torch.mul(buf[:4], w)" in str(ei.value)


def test_peer_range_is_caught(device, comm):
    peer = comm.buffers[1]
    with pytest.raises(SavedTensorAliasError, match="buffer range 1 .* 'ub_ag'"):
        with debug.check_saved_tensors():
            SaveInput.apply(peer[2:3], _w(device))


def test_view_at_offset_inside_buffer_is_caught(device, comm):
    buf = comm.get_buffer()
    view = buf.view(-1)[517:517 + 16]
    with debug.check_saved_tensors(action="record") as chk:
        SaveInput.apply(view, _w(device))
    (v,) = chk.violations
    assert v.tensor_range[0] == buf.data_ptr() and f"+{517 * 4} bytes" in v.message


def test_our_linear_saving_a_buffer_view_is_caught(device, comm):
    """tec.Linear fed a get_buffer() view saves it (its input): caught, named
    after the layer's Function and module."""
    m = tec.Linear(16, 8, device=device)
    model = torch.nn.Sequential(m)
    with pytest.raises(SavedTensorAliasError) as ei:
        with debug.check_saved_tensors(model=model):
            model(comm.get_buffer()[:4])
    msg = str(ei.value)
    assert "_LinearFn (autograd.Function)" in msg and "module '0' (Linear)" in msg


def test_wrapper_subclass_inner_tensor_is_checked(comm):
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    buf = comm.get_buffer()
    if buf.device.type != "cpu":
        pytest.skip("CPU only")
    t = two_tensor.TwoTensor(buf[0].clone(), buf[0])
    w = torch.randn(16, requires_grad=True)
    with debug.check_saved_tensors(action="record") as chk:
        torch.mul(t, w)
    assert len(chk.violations) >= 1


# ------------------------------------------------------------- positive tests

def _model(device):
    return torch.nn.Sequential(
        tec.LayerNormLinear(32, 64, device=device), torch.nn.GELU(), tec.Linear(64, 32, device=device),
        tec.LayerNormLinear(32, 64, normalization="RMSNorm", device=device), torch.nn.GELU(),
        tec.Linear(64, 32, device=device))


def test_our_layers_pass(device, comm):
    model = _model(device)
    x = torch.randn(8, 4, 32, device=device, requires_grad=True)
    comm.get_buffer().copy_(torch.randn(64, 16))        # a buffer in use: only copies are saved
    with debug.check_saved_tensors(model=model) as chk:
        model(x).square().sum().backward()
        model(comm.get_buffer()[:32].reshape(8, 4, 16).repeat(1, 1, 2).clone()).sum().backward()
    assert chk.violations == []
    assert chk.checked >= 2 * (5 + 5 + 2 * 2 + 2)      # the layers', GELUs' (and square's) saves


def test_in_place_change_of_a_saved_tensor_is_still_caught(comm):
    """Saved-tensor hooks turn autograd's in-place check off; the checker keeps
    it: a tensor modified after it was saved fails backward, as without the
    checker, instead of silently giving wrong gradients."""
    x = torch.randn(8, requires_grad=True)
    with tec.debug.check_saved_tensors(comm):
        a = x * 2
        b = a.sin()  # saves a
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    x.grad = None
    with tec.debug.check_saved_tensors(comm):  # unmodified: the same gradient as without it
        a = x * 2
        a.sin().sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()))


def test_layernorm_output_changed_in_place_under_the_checker_fails(comm):
    """LayerNormLinear's returned normalised input is also saved for backward:
    changing it in place is refused at once, with or without the checker."""
    m = tec.LayerNormLinear(16, 8, device="cpu", return_layernorm_output=True)
    for shape in ((4, 16), (2, 2, 16)):
        x = torch.randn(*shape, requires_grad=True)
        for checker in (True, False):
            if checker:
                with tec.debug.check_saved_tensors(comm):
                    y, ln = m(x)
            else:
                y, ln = m(x)
            assert ln.shape == x.shape
            with pytest.raises(RuntimeError, match="inplace"):
                ln.mul_(2)


def test_adjacent_storage_is_not_flagged():
    """Storages that end exactly where a buffer starts, or start exactly where
    it ends, do not overlap it (ranges are end-exclusive)."""
    mem = bytearray(1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # frombuffer on a writable bytearray warns on some versions
        whole = torch.frombuffer(mem, dtype=torch.uint8)
        below = torch.frombuffer(memoryview(mem)[0:256], dtype=torch.float32)
        above = torch.frombuffer(memoryview(mem)[512:1024], dtype=torch.float32)
        straddle = torch.frombuffer(memoryview(mem)[508:1024], dtype=torch.float32)
    base = whole.data_ptr()
    assert below.untyped_storage().data_ptr() == base and above.untyped_storage().data_ptr() == base + 512
    c = FakeComm("edge", (base + 256, 256))
    w = torch.randn(1, requires_grad=True)
    with debug.check_saved_tensors(c, action="record") as chk:
        SaveInput.apply(below, w)
        SaveInput.apply(above, w)
    assert chk.violations == [] and chk.checked == 4
    with debug.check_saved_tensors(c, action="record") as chk:
        SaveInput.apply(straddle, w)
    assert len(chk.violations) == 1 and chk.violations[0].comm == "edge"


def test_extent_view_checks_only_addressed_bytes():
    big = torch.zeros(256)
    c = FakeComm("part", (big.data_ptr() + 128 * 4, 64 * 4))   # only big[128:192] is "the buffer"
    w = torch.randn(1, requires_grad=True)
    with debug.check_saved_tensors(c, action="record") as chk:
        SaveInput.apply(big[:8], w)
    assert len(chk.violations) == 1                   # same storage: a hazard by default
    with debug.check_saved_tensors(c, action="record", extent="view") as chk:
        SaveInput.apply(big[:8], w)                   # bytes 0..32: outside
        SaveInput.apply(big[120:128], w)              # ends exactly at the range
        SaveInput.apply(big[121:129], w)              # one element inside
        SaveInput.apply(big[100:200:50], w)           # strided: touches 150
        SaveInput.apply(big[:0], w)                   # empty
    assert [v.shape for v in chk.violations] == [(8,), (2,)]


def test_no_comms_no_checks_no_flags(device):
    for c in debug.live_comms():
        debug.unregister_comm(c)
    buf = torch.zeros(8, device=device)
    with debug.check_saved_tensors() as chk:
        SaveInput.apply(buf, _w(device, 8)).sum().backward()
    assert chk.violations == [] and chk.checked == 2


# ------------------------------------------------------------- comms argument, registry

def test_default_comms_is_the_live_registry():
    a = debug.register_comm(FakeComm("a", torch.zeros(8)))
    assert a in debug.live_comms()
    w = torch.randn(8, requires_grad=True)
    with debug.check_saved_tensors(action="record") as chk:
        b = debug.register_comm(FakeComm("b", torch.zeros(8)))      # created inside: picked up
        SaveInput.apply(a.buffers[0], w)
        SaveInput.apply(b.buffers[0], w)
        debug.unregister_comm(a)                                      # closed: dropped
        SaveInput.apply(a.buffers[0], w)
    assert [v.comm for v in chk.violations] == ["a", "b"]
    del b
    gc.collect()
    assert [c.name for c in debug.live_comms()] == []


def test_explicit_comms_only():
    a, b = FakeComm("a", torch.zeros(8)), FakeComm("b", torch.zeros(8))
    debug.register_comm(a)
    w = torch.randn(8, requires_grad=True)
    with debug.check_saved_tensors(b, action="record") as chk:
        SaveInput.apply(a.buffers[0], w)
        SaveInput.apply(b.buffers[0], w)
    assert [v.comm for v in chk.violations] == ["b"]
    with debug.check_saved_tensors([a, b], action="record") as chk:
        SaveInput.apply(a.buffers[0], w)
    assert [v.comm for v in chk.violations] == ["a"]
    debug.unregister_comm(a)


def test_registry_needs_weakrefs_and_ranges():
    class NoWeak:
        __slots__ = ()

        def buffer_ranges(self):
            return []

    with pytest.raises(TypeError, match="weak references"):
        debug.register_comm(NoWeak())
    with pytest.raises(TypeError, match="buffer_ranges"):
        debug.register_comm(object())
    with pytest.raises(ValueError, match="action"):
        debug.check_saved_tensors(action="explode")
    with pytest.raises(TypeError, match="communicators"):
        debug.check_saved_tensors([object()])


# ------------------------------------------------------------- actions

def test_action_warn_and_record(comm):
    buf = comm.get_buffer()
    w = _w(buf.device.type)
    with pytest.warns(SavedTensorAliasWarning, match="ub_ag") as rec:
        with debug.check_saved_tensors(action="warn") as chk:
            y = SaveInput.apply(buf[:2], w)
    assert rec[0].filename == __file__          # points at the line that saved
    assert len(chk.violations) == 1
    y.sum().backward()                          # warn and record leave autograd working
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with debug.check_saved_tensors(action="record") as chk:
            SaveInput.apply(buf[:2], w)
    assert len(chk.violations) == 1


def test_raise_is_a_runtime_error(comm):
    with pytest.raises(RuntimeError):
        with debug.check_saved_tensors():
            SaveInput.apply(comm.get_buffer()[:1], _w(comm.get_buffer().device.type))


# ------------------------------------------------------------- nesting, other hooks, threads

def test_nested_checkers_both_check():
    a, b = FakeComm("a", torch.zeros(8)), FakeComm("b", torch.zeros(8))
    w = torch.randn(8, requires_grad=True)
    with debug.check_saved_tensors(a, action="record") as outer:
        with debug.check_saved_tensors(b, action="record") as inner:
            SaveInput.apply(a.buffers[0], w)
            SaveInput.apply(b.buffers[0], w)
        SaveInput.apply(b.buffers[0], w)            # inner is gone
    assert [v.comm for v in outer.violations] == ["a"]
    assert [v.comm for v in inner.violations] == ["b"]
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_composes_with_other_saved_tensor_hooks():
    """A user's hooks outside the checker keep running; hooks pushed inside it
    do not hide saved tensors from it."""
    c = FakeComm("c", torch.zeros(8))
    w = torch.randn(8, requires_grad=True)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t.detach()

    def unpack(t):
        unpacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        with debug.check_saved_tensors(c, action="record") as chk:
            y = SaveInput.apply(c.buffers[0], w)
    y.sum().backward()
    assert len(chk.violations) == 1 and len(packed) == 2 and len(unpacked) == 2
    packed.clear()
    with debug.check_saved_tensors(c, action="record") as chk:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = SaveInput.apply(c.buffers[0], w)
    assert len(chk.violations) == 1 and len(packed) == 2
    assert torch._C._autograd._push_saved_tensors_default_hooks is debug._push_hooks   # unpatched after


def test_threads_are_independent():
    c = FakeComm("c", torch.zeros(8))
    w = torch.randn(8, requires_grad=True)
    results, ready, go = {}, threading.Barrier(2), threading.Event()

    def checked():
        with debug.check_saved_tensors(c, action="record") as chk:
            ready.wait()
            go.wait()
            SaveInput.apply(c.buffers[0], w)
        results["checked"] = len(chk.violations)

    def unchecked():
        ready.wait()
        SaveInput.apply(c.buffers[0], w)        # no checker in this thread
        results["unchecked"] = torch._C._autograd._top_saved_tensors_default_hooks(True)
        go.set()

    ts = [threading.Thread(target=checked), threading.Thread(target=unchecked)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == {"checked": 1, "unchecked": None}


# ------------------------------------------------------------- activation checkpointing

class SaveBufferOnRecompute(torch.autograd.Function):
    """Saves a copy in the first forward and a buffer view when recomputed (the
    bug that only recomputation shows)."""
    buffer = None

    @staticmethod
    def forward(ctx, x):
        b = SaveBufferOnRecompute.buffer[: x.shape[0]]
        ctx.save_for_backward(b if torch._C._current_graph_task_id() != -1 else b.clone())
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (b,) = ctx.saved_tensors
        return g * 2 + 0 * b


CHECKPOINTS = [pytest.param(ckpt.checkpoint, id="torch"),
               pytest.param(getattr(tec, "checkpoint", None), id="tec",
                            marks=pytest.mark.skipif(not hasattr(tec, "checkpoint"), reason="no tec.checkpoint"))]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputation_is_checked(device, comm, use_reentrant, checkpoint):
    SaveBufferOnRecompute.buffer = comm.get_buffer()
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with debug.check_saved_tensors(action="record") as chk:
        y = checkpoint(lambda t: SaveBufferOnRecompute.apply(t.sin()), x, use_reentrant=use_reentrant)
        assert chk.violations == []
        y.sum().backward()
    (v,) = chk.violations
    assert v.during_backward and "SaveBufferOnRecompute" in v.saver and "recomputation" in v.message
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputation_raises(device, comm, use_reentrant):
    SaveBufferOnRecompute.buffer = comm.get_buffer()
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with debug.check_saved_tensors():
        y = ckpt.checkpoint(lambda t: SaveBufferOnRecompute.apply(t.sin()), x, use_reentrant=use_reentrant)
        with pytest.raises(SavedTensorAliasError, match="recomputation"):
            y.sum().backward()


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_layers_pass(device, comm, use_reentrant, checkpoint):
    model = _model(device)
    x = torch.randn(8, 4, 32, device=device, requires_grad=True)
    with debug.check_saved_tensors(model=model) as chk:
        checkpoint(model, x, use_reentrant=use_reentrant).sum().backward()
    assert chk.violations == [] and chk.checked > 10


def test_non_reentrant_forward_save_is_caught_in_forward(comm):
    """Non-reentrant checkpointing packs forward saves with its own hooks; the
    checker is composed with them, so the first forward is checked too."""
    buf = comm.get_buffer()
    w = _w(buf.device.type)
    with pytest.raises(SavedTensorAliasError, match="SaveInput"):
        with debug.check_saved_tensors():
            ckpt.checkpoint(lambda t: SaveInput.apply(buf[:1] + 0 * t, w) + SaveInput.apply(buf[:1], w), w,
                            use_reentrant=False)


# ------------------------------------------------------------- the real communicator

needs_comm_overlap = pytest.mark.skipif(not hasattr(tec, "CommOverlap"), reason="CommOverlap not built in this tree")


@needs_comm_overlap
def test_real_comm_overlap_buffer_is_caught(device):
    c = tec.CommOverlap([64, 16], torch.float32, tp_size=1, name="ub_test", device=device)
    try:
        w = torch.randn(16, requires_grad=True, device=device)
        with pytest.raises(SavedTensorAliasError, match="'ub_test'"):
            with debug.check_saved_tensors(c):
                SaveInput.apply(c.get_buffer()[3:5], w)
        with pytest.raises(SavedTensorAliasError, match="'ub_test'"):
            with debug.check_saved_tensors(c):
                SaveInput.apply(c.get_buffer(shape=(4, 8), dtype=torch.bfloat16)[1:],
                                torch.randn(8, dtype=torch.bfloat16, requires_grad=True, device=device))
        with debug.check_saved_tensors(c) as chk:         # a copy is fine
            SaveInput.apply(c.get_buffer()[3:5].clone(), w).sum().backward()
        assert chk.violations == [] and chk.checked == 2
    finally:
        c.close()


@needs_comm_overlap
def test_real_comm_overlap_registers_itself(device):
    """CommOverlap calls debug.register_comm(self) once its peers are mapped
    and debug.unregister_comm(self) in close()."""
    c = tec.CommOverlap([64, 16], torch.float32, tp_size=1, name="ub_registered", device=device)
    try:
        assert c in debug.live_comms()
        with pytest.raises(SavedTensorAliasError, match="'ub_registered'"):
            with debug.check_saved_tensors():
                SaveInput.apply(c.get_buffer()[:1], torch.randn(16, requires_grad=True, device=device))
    finally:
        c.close()
    assert c not in debug.live_comms()


def test_a_compiled_function_saving_a_buffer_view_is_caught(comm):
    """Around a torch.compile'd function the checker sees what the compiled
    graph saves for backward: a planted alias of a buffer is caught."""
    buf = comm.get_buffer()
    w = _w(buf.device)

    def f(w):
        return torch.mul(buf[:4], w)    # mul saves its other operand: a view of the buffer

    compiled = torch.compile(f, fullgraph=True)
    with pytest.raises(SavedTensorAliasError):
        with debug.check_saved_tensors():
            compiled(w)
    # (the compiler may save the buffer itself and redo a copy in backward: a function
    # that reads the buffer at all is flagged, rightly, since its backward reads it later)
    other = torch.randn(4, 16, device=buf.device)
    with debug.check_saved_tensors(action="record") as chk:
        torch.compile(lambda w: torch.mul(other, w), fullgraph=True)(w)
    assert chk.checked > 0 and chk.violations == []
