"""The engine's own NCCL communicator (csrc/core/cuda/nccl.cu,
transformer_engine_c/distributed.py: set_collectives, "auto" by default).

CPU: the switch and its checks, "auto"'s choice per group, the clear error
without the CUDA backend, and CPU tensors still going through the process
group. One GPU
(tests/engine_nccl_check.py, a process per case): the collectives on a
one-rank communicator against the process group's, ordered on the current
stream, asynchronous ones joined back (a too-late wait refused, a dropped
one waited for), two threads at once; captured in a CUDA graph and replayed
while the watchdog polls; a first collective inside a capture refused; the watchdog ending a process whose collective
never finishes, naming it; a creation whose peer never comes timing out;
an interpreter exiting with a communicator open.
Two ranks: tests/distributed/test_engine_collectives.py."""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import transformer_engine_c as tec
from transformer_engine_c import _C, distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPU = torch.cuda.is_available() and tec._engine.cuda_backend_built()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the CUDA backend (this machine has none)")


def test_with_collectives_restores_the_setting():
    calls = []
    before = distributed.collectives()
    run = distributed.with_collectives("engine", lambda a, b=0: calls.append((distributed.collectives(), a, b)))
    run(1, b=2)
    assert calls == [("engine", 1, 2)] and distributed.collectives() == before
    boom = distributed.with_collectives("engine", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom()
    assert distributed.collectives() == before
    with pytest.raises(ValueError, match="collectives must be one of"):
        distributed.with_collectives("nccl", print)


def test_set_collectives_checks():
    if os.environ.get("TEC_COLLECTIVES", "") in ("", "auto"):
        assert distributed.collectives() == "auto"  # the default
    before, timeout = distributed.collectives(), distributed._collectives["timeout_s"]
    try:
        distributed.set_collectives("torch")
        with pytest.raises(ValueError, match="collectives must be one of"):
            distributed.set_collectives("nccl")
        with pytest.raises(ValueError, match="timeout_s must be in"):
            distributed.set_collectives("engine", timeout_s=0)
        assert distributed.collectives() == "torch"
        distributed.set_collectives("engine", timeout_s=5)
        assert distributed.collectives() == "engine" and distributed._collectives["timeout_s"] == 5.0
        distributed.set_collectives("auto")
        assert distributed.collectives() == "auto"
    finally:
        distributed.set_collectives(before, timeout_s=timeout)


def test_environment_sets_collectives():
    code = ("from transformer_engine_c import distributed as d; "
            "print(d.collectives(), d._collectives['timeout_s'])")
    env = dict(os.environ, TEC_COLLECTIVES="engine", TEC_COLLECTIVES_TIMEOUT="42")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["engine", "42.0"], out.stderr
    env["TEC_COLLECTIVES"] = "bogus"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "collectives must be one of" in out.stderr


class _CudaLike:
    """What _engine_for reads of a tensor, as a CUDA bf16 tensor has it."""
    is_cuda, dtype = True, torch.bfloat16

    @staticmethod
    def get_device():
        return 0


@pytest.mark.parametrize("backend, version, engine", [
    ("nccl", 22809, True), ("cpu:gloo,cuda:nccl", 21000, True),  # NCCL moves CUDA tensors: the engine
    ("nccl", 20900, False), ("nccl", 0, False),  # NCCL too old, or not loadable: the process group
    ("gloo", 22809, False), ("fake", 22809, False)])  # CUDA tensors through another backend: its own way
def test_auto_chooses_per_group(monkeypatch, backend, version, engine):
    seen = []
    monkeypatch.setattr(distributed.dist, "get_backend", lambda pg: seen.append(pg) or backend)
    monkeypatch.setattr(distributed, "device_code", lambda device: 0)
    monkeypatch.setattr(distributed._C, "nccl_version", lambda: version)
    monkeypatch.setattr(distributed, "_auto_groups", {})
    monkeypatch.setattr(distributed.torch.cuda, "is_current_stream_capturing", lambda: False)
    group = object()
    x = _CudaLike()
    for kind, want in (("auto", engine), ("engine", True), ("torch", False)):
        assert distributed.with_collectives(kind, distributed._engine_for)(x, group) is want, kind
    assert distributed.with_collectives("auto", distributed._engine_for)(x, group) is engine
    assert seen == [group]  # decided once per group
    if engine:  # a capture before the group's communicator exists: "auto" keeps the process group
        monkeypatch.setattr(distributed.torch.cuda, "is_current_stream_capturing", lambda: True)
        assert not distributed.with_collectives("auto", distributed._engine_for)(x, group)
        assert distributed.with_collectives("engine", distributed._engine_for)(x, group)  # refused at creation
        monkeypatch.setattr(distributed, "_engine_comms", {(group, 0): ("comm", 2)})
        assert distributed.with_collectives("auto", distributed._engine_for)(x, group)  # made: captured too
    x.is_cuda = False  # CPU tensors: the process group, whatever the setting
    assert not any(distributed.with_collectives(k, distributed._engine_for)(x, group) for k in ("auto", "engine"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only: this machine has a GPU, whose backend loads")
def test_without_cuda_backend_is_a_clear_error():
    if _C.has_cuda_backend():
        pytest.skip("the CUDA backend is loaded in this process")
    assert _C.nccl_version() == 0
    with pytest.raises(tec.EngineError, match="engine collectives need the CUDA backend"):
        _C.nccl_unique_id()
    with pytest.raises(tec.EngineError, match="engine collectives need the CUDA backend"):
        _C.nccl_create(0, bytes(128), 1, 0, 1.0, "g")


def test_binding_checks_arguments():
    with pytest.raises(ValueError, match="id must be 128 bytes"):
        _C.nccl_create(0, b"short", 1, 0, 1.0, "g")
    with pytest.raises(ValueError, match="rank"):
        _C.nccl_create(0, bytes(128), 2, 2, 1.0, "g")
    with pytest.raises(ValueError):  # not a communicator capsule
        _C.nccl_run(object(), 0, 0, 0, 0, 0, 0, 0)


def test_cpu_tensors_take_the_process_group():
    """With the engine's collectives on, CPU tensors still go through gloo."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        x = torch.randn(4, 8)
        before = distributed.collectives()
        distributed.set_collectives("engine")
        try:
            assert torch.equal(distributed.all_gather_rows(x, group, 1), x)
            out = torch.empty_like(x)
            distributed._all_gather_into(out, x, group, False)
            assert torch.equal(out, x)
            distributed._reduce_scatter_into(out, x * 3, group)
            assert torch.equal(out, x * 3)
        finally:
            distributed.set_collectives(before)
        assert not distributed._engine_comms
    finally:
        if fresh:
            dist.destroy_process_group()


def run_check(mode, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_nccl_check.py"), mode], env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


@needs_gpu
@pytest.mark.parametrize("mode", ["collectives", "capture", "capture_first", "init_timeout", "exit_open"])
def test_engine_collectives_gpu(mode):
    proc, _ = run_check(mode, timeout=90 if mode == "init_timeout" else 240)
    assert proc.returncode == 0 and f"PASS {mode}" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    for bad in ("terminate called", "Segmentation", "has not finished", "Traceback"):
        assert bad not in proc.stderr, proc.stderr[-4000:]


@needs_gpu
def test_watchdog_ends_a_stuck_collective_gpu():
    proc, took = run_check("watchdog")
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "enqueued" in proc.stdout and "FAIL" not in proc.stdout, proc.stdout
    assert "NCCL all-gather #2 of the 1-rank group" in proc.stderr and "timeout 1.0 s" in proc.stderr, proc.stderr
    assert "has not finished, enqueued" in proc.stderr, proc.stderr
    assert took < 30, f"the watchdog took {took:.1f} s for a 1 s timeout (the stuck kernel spins ~60 s)"


def test_engine_work_holds_its_tensors_until_waited(monkeypatch):
    """An asynchronous engine collective's work keeps its tensors alive until
    wait() (the side stream uses them behind the allocator's back), joins
    once, and joins by itself when dropped unwaited (the join recorded here
    instead of made)."""
    import gc
    import weakref

    joins = []
    monkeypatch.setattr(distributed._C, "nccl_join", lambda comm, ticket, stream: joins.append((comm, ticket, stream)))
    x, out = torch.randn(4), torch.empty(8)
    ref = weakref.ref(x)
    work = distributed._EngineWork("comm", 7, 99, (x, out))
    del x
    gc.collect()
    assert ref() is not None, "the work let its input go before wait()"
    assert work.wait() and work.wait()
    assert joins == [("comm", 7, 99)], joins
    gc.collect()
    assert ref() is None, "the work kept its input after wait()"
    distributed._EngineWork("comm", 8, 5, (torch.empty(1),))  # dropped at once
    gc.collect()
    assert joins[-1] == ("comm", 8, 5), joins
