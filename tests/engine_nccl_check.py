"""The engine's own NCCL communicator on one GPU (a one-rank NCCL process
group): run by tests/test_engine_nccl.py, one mode per process, because the
watchdog and the creation timeout end or strand the process by design.
Prints "PASS <mode>" on success.

    python tests/engine_nccl_check.py {collectives,capture,capture_first,watchdog,init_timeout,exit_open}
"""
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c import _C, distributed  # noqa: E402

DEV = torch.device("cuda", 0)
SPIN = int(1.5e9)  # GPU cycles torch.cuda._sleep spins: about a second on an H200


def init():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(DEV)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=DEV)
    return dist.new_group([0])


def through(engine, fn):
    return distributed.with_collectives("engine" if engine else "torch", fn)()


def collectives():
    group = init()
    distributed.set_collectives("engine", timeout_s=600)
    distributed.set_collectives("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(8, 16, device=DEV).to(dtype)
        for engine in (False, True):
            # The collective follows the stream's earlier work: a slow kernel,
            # then x doubled; the gather must see the doubled x.
            src = x.clone()
            torch.cuda._sleep(SPIN // 20)
            src.mul_(2)
            out = torch.empty_like(src)
            through(engine, lambda: distributed._all_gather_into(out, src, group, False))
            assert torch.equal(out, x * 2), f"all-gather {dtype} engine={engine}"
            torch.cuda._sleep(SPIN // 20)
            src.mul_(2)
            out2 = torch.empty_like(src)
            work = through(engine, lambda: distributed._all_gather_into(out2, src, group, True))
            work.wait()
            assert torch.equal(out2, x * 4), f"async all-gather {dtype} engine={engine}"
            rs = torch.empty_like(src)
            through(engine, lambda: distributed._reduce_scatter_into(rs, src, group))
            assert torch.equal(rs, x * 4), f"reduce-scatter {dtype} engine={engine}"
            ar = src.clone()
            through(engine, lambda: distributed.all_reduce(ar, group, 2))  # size > 1: the collective runs
            assert torch.equal(ar, x * 4), f"all-reduce {dtype} engine={engine}"
        # On another stream: the collective runs on the current one.
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            src = x.clone()
            torch.cuda._sleep(SPIN // 20)
            src.add_(1)
            out = torch.empty_like(src)
            through(True, lambda: distributed._all_gather_into(out, src, group, False))
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(out, x + 1), f"all-gather on a side stream {dtype}"
    assert len(distributed._engine_comms) == 1, distributed._engine_comms
    # Two threads at once on one communicator (each on its own stream), as the
    # forward's thread and autograd's may: every result right, nothing crashes.
    distributed.set_collectives("engine")
    errors = []

    def worker(seed):
        try:
            s = torch.cuda.Stream()
            g = torch.Generator(device=DEV).manual_seed(seed)
            with torch.cuda.stream(s):
                for i in range(200):
                    src = torch.randn(32, 16, device=DEV, generator=g)
                    out = torch.empty_like(src)
                    work = distributed._all_gather_into(out, src, group, i % 2 == 1)
                    if work is not None:
                        work.wait()
                    if not torch.equal(out, src):
                        errors.append(f"thread {seed}, call {i}")
            s.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    distributed.set_collectives("torch")
    assert not errors, errors[:5]
    # A wait far too late (64 collectives later: its slot reused) is an
    # error, not a wait on another collective.
    distributed.set_collectives("engine")
    src = torch.randn(8, 16, device=DEV)
    out = torch.empty_like(src)
    late = distributed._all_gather_into(out, src, group, True)
    for _ in range(64):
        distributed._all_gather_into(torch.empty_like(src), src, group, False)
    try:
        late.wait()
    except ValueError as e:
        assert "cannot be waited for any more" in str(e), e
    else:
        raise AssertionError("a wait on a reused slot passed")
    # A work dropped without wait() waits then; its tensors lived until it did.
    src = torch.randn(8, 16, device=DEV)
    out = torch.empty_like(src)
    torch.cuda._sleep(SPIN // 20)
    distributed._all_gather_into(out, src.clone(), group, True)  # the input's only reference is the work's
    torch.full_like(src, 7.0)  # takes the clone's block: after the collective only if the work waited
    torch.cuda.synchronize()
    assert torch.equal(out, src), "dropped async work"
    distributed.set_collectives("torch")
    # Bad input: named, before anything is enqueued.
    x = torch.randn(8, 16, device=DEV)
    for out, want in ((torch.empty(4, 16, device=DEV), "all-gather over 1 ranks"),
                      (torch.empty(8, 16, device=DEV, dtype=torch.bfloat16), "expected the same device and dtype"),
                      (torch.empty(16, 8, device=DEV).t(), "contiguous")):
        try:
            through(True, lambda: distributed._all_gather_into(out, x, group, False))
        except ValueError as e:
            assert want in str(e), e
        else:
            raise AssertionError(f"no error for {want}")
    # Closed communicators raise; the next collective makes a new one.
    cap = next(iter(distributed._engine_comms.values()))[0]
    distributed.close_engine_collectives()
    try:
        _C.nccl_run(cap, 0, x.data_ptr(), x.data_ptr(), x.numel(), 0, 0, 0)
    except tec.EngineError as e:
        assert "closed" in str(e), e
    else:
        raise AssertionError("a closed communicator ran")
    out = torch.empty_like(x)
    through(True, lambda: distributed._all_gather_into(out, x, group, False))
    assert torch.equal(out, x) and len(distributed._engine_comms) == 1
    assert _C.nccl_version() >= 20000
    distributed.close_engine_collectives()
    print("PASS collectives", flush=True)


def capture():
    """Collectives captured in a CUDA graph replay correctly, while the
    watchdog polls collectives still running from before the capture (its
    queries must not invalidate the capture)."""
    group = init()
    distributed.set_collectives("engine", timeout_s=60)
    x = torch.randn(64, 32, device=DEV)
    out, out2, rs = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def step():
        distributed._all_gather_into(out, x, group, False)
        distributed._all_gather_into(out2, out, group, True).wait()
        distributed._reduce_scatter_into(rs, out2, group)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up (makes the communicator) off the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda._sleep(SPIN)  # about a second of work still pending
    step()  # followed by the watchdog while the capture below runs
    g = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        step()
    for i in range(5):
        x.copy_(torch.randn_like(x) + i)
        rs.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(rs, x), f"replay {i}"
    took = time.perf_counter() - t0
    distributed.close_engine_collectives()
    print(f"PASS capture ({took:.2f} s with the watchdog polling)", flush=True)


def capture_first():
    """A group's first engine collective inside a CUDA graph capture: a clear
    error (the communicator cannot be made there), and the next eager call
    works."""
    group = init()
    distributed.set_collectives("engine", timeout_s=60)
    x = torch.randn(8, 16, device=DEV)
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            distributed._all_gather_into(out, x, group, False)
    except RuntimeError as e:
        if "cannot be captured in a CUDA graph" not in str(e):
            raise
    else:
        raise AssertionError("the communicator was made during a capture")
    torch.cuda.synchronize()
    assert not distributed._engine_comms
    distributed._all_gather_into(out, x, group, False)
    torch.cuda.synchronize()
    assert torch.equal(out, x)
    distributed.close_engine_collectives()
    print("PASS capture_first", flush=True)


def watchdog():
    """A collective that never finishes within the timeout: the watchdog
    names it on stderr and ends the process (exit 1)."""
    group = init()
    distributed.set_collectives("engine", timeout_s=1.0)
    x = torch.randn(8, 16, device=DEV)
    out = torch.empty_like(x)
    distributed._all_gather_into(out, x, group, False)  # #1 finishes
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN * 60)  # about a minute before #2 can run
    distributed._all_gather_into(out, x, group, False)
    print("enqueued", flush=True)
    torch.cuda.synchronize()
    print("FAIL watchdog: the process outlived its timeout", flush=True)


def exit_open():
    """The interpreter exits with a communicator open and a collective still
    running: the package aborts it and stops its watchdog while the
    interpreter and CUDA are whole (exit 0, nothing on stderr about it)."""
    group = init()
    distributed.set_collectives("engine", timeout_s=60)
    x = torch.randn(8, 16, device=DEV)
    out = torch.empty_like(x)
    distributed._all_gather_into(out, x, group, False)
    torch.cuda._sleep(SPIN // 4)
    distributed._all_gather_into(out, x, group, True)
    print("PASS exit_open", flush=True)


def init_timeout():
    """Creating a communicator whose other rank never comes: a timeout error
    naming the group, not a hang; the interpreter then exits normally while
    NCCL's init stays blocked on its helper thread."""
    torch.cuda.set_device(DEV)
    tec._engine.device_code(DEV)  # loads the CUDA backend
    t0 = time.perf_counter()
    try:
        _C.nccl_create(0, _C.nccl_unique_id(), 2, 0, 2.0, "a test group of 2")
    except tec.CommTimeoutError as e:
        took = time.perf_counter() - t0
        assert "not every rank joined within 2.0 s" in str(e) and "a test group of 2" in str(e), e
        assert took < 10, took
        print(f"PASS init_timeout ({took:.1f} s): {e}", flush=True)
        return  # a normal exit, with NCCL's init still blocked on its thread
    raise AssertionError("no timeout")


if __name__ == "__main__":
    {"collectives": collectives, "capture": capture, "watchdog": watchdog,
     "init_timeout": init_timeout, "exit_open": exit_open, "capture_first": capture_first}[sys.argv[1]]()
    if dist.is_initialized() and sys.argv[1] != "exit_open":
        dist.destroy_process_group()
