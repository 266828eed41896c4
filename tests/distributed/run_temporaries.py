"""torchrun runner: the layers' reused temporaries (module/_temporaries.py: a
gathered input, a partial sum before its reduce-scatter, a dgrad before its
reduce-scatter) give the bits fresh allocations give when calls follow each
other without synchronising: back to back, on CUDA on three streams in
turn, and from two threads at once, each with layers on its own process
group (two threads' collectives on one group would pair up differently on
the ranks) and, on CUDA, its own stream (with NCCL taking turns call by
call: Turns). Sequence-parallel Linear (column,
row), LayerNormLinear and LayerNormMLP, no-grad forwards and forward +
backward (torch.autograd.grad, so nothing accumulates). The references run
with the temporaries off. Needs 2 or more ranks (with one, nothing is
gathered). Prints "PASS run_temporaries".

    torchrun --nproc_per_node=2 tests/distributed/run_temporaries.py [--device cuda]
    torchrun --nproc_per_node=2 tests/distributed/run_temporaries.py --device cuda --gloo
        (gloo's collectives on CUDA tensors: both ranks may share one GPU)
"""
import argparse
import contextlib
import os
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformer_engine_c as tec  # noqa: E402
from transformer_engine_c.module import _temporaries  # noqa: E402
from common import setup  # noqa: E402

IN, OUT, FFN, CALLS = 64, 48, 96, 6


def layers(dtype, size, group):
    torch.manual_seed(3)
    kw = dict(params_dtype=dtype, sequence_parallel=True, tp_size=size, tp_group=group)
    return {"column": tec.Linear(IN, OUT, parallel_mode="column", **kw),
            "row": tec.Linear(IN, OUT, parallel_mode="row", **kw),
            "lnl": tec.LayerNormLinear(IN, OUT, parallel_mode="column", **kw),
            "mlp": tec.LayerNormMLP(IN, FFN, set_parallel_mode=True, **kw)}


def inputs(name, dtype, rank, size, seed, dev):
    g = torch.Generator(device="cpu").manual_seed(1000 * seed + rank)
    rows = 8
    k = IN // size if name == "row" else IN
    x = torch.randn(rows, k, generator=g, device="cpu").to(dev, dtype)
    out_rows = rows * size if name in ("column", "lnl") else rows // size if name == "row" else rows
    n = OUT // size if name in ("column", "lnl") else IN if name == "mlp" else OUT
    dy = torch.randn(out_rows, n, generator=g, device="cpu").to(dev, dtype)
    return x, dy


def call(m, x, dy):
    """(no-grad output, output, x's gradient, the parameters' gradients)."""
    with torch.no_grad():
        y0 = m(x)
    xx = x.detach().requires_grad_()
    y = m(xx)
    params = [p for p in m.parameters() if p.requires_grad]
    grads = torch.autograd.grad(y, [xx] + params, dy)
    return [y0, y.detach()] + list(grads)


def run_all(ms, work, stream_of, turn=contextlib.nullcontext):
    """Every (layer, input) of `work` in order, call i on stream_of(i) and
    inside turn()."""
    out = []
    for i, (name, x, dy) in enumerate(work):
        s = stream_of(i)
        if s is None:
            with turn():
                out.append(call(ms[name], x, dy))
            continue
        with turn():
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                res = call(ms[name], x, dy)
            for t in res:  # the results are read on the current stream below
                t.record_stream(torch.cuda.current_stream())
            torch.cuda.current_stream().wait_stream(s)
        out.append(res)
    return out


class Turns:
    """Threads 0..n-1 take turns, one call each in a round. NCCL needs the
    collectives of two communicators issued in the same order on every rank
    (its kernels block until their peers join): two threads issuing them
    freely can deadlock the ranks (seen with two ranks sharing one GPU).
    Their calls still interleave, each thread with its own stream and
    temporaries."""

    def __init__(self, n):
        self.cv, self.turn, self.n = threading.Condition(), 0, n

    @contextlib.contextmanager
    def of(self, t):
        with self.cv:
            if not self.cv.wait_for(lambda: self.turn == t, timeout=300):
                raise TimeoutError(f"thread {t} waited 300 s for its turn (the other thread failed?)")
        try:
            yield
        finally:
            with self.cv:
                self.turn = (t + 1) % self.n
                self.cv.notify_all()


def same(a, b, what):
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.shape == v.shape and torch.equal(u, v), \
            f"{what}: item {i} differs (max {(u.float() - v.float()).abs().max().item()})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--gloo", action="store_true", help="CUDA tensors through gloo (ranks may share a GPU)")
    args = ap.parse_args()
    if args.gloo:
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        torch.set_default_device(dev)
        # gloo's own path: with TEC_COLLECTIVES=engine the layers would make an NCCL
        # communicator, which two ranks on one GPU cannot have without TEC_SHARE_GPU
        tec.distributed.set_collectives("torch")
    else:
        rank, size, dev = setup(args.device)
    assert size >= 2, "run_temporaries needs 2 or more ranks"
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda and not args.gloo else torch.float32
    ms = layers(dtype, size, dist.group.WORLD)
    ms_other = layers(dtype, size, dist.new_group(list(range(size))))  # the second thread's
    work = [(name, *inputs(name, dtype, rank, size, i, dev)) for i in range(CALLS) for name in ms]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    limit = _temporaries._TEMP_BYTES
    _temporaries._TEMP_BYTES = -1  # the references: a fresh tensor for every temporary
    ref = run_all(ms, work, lambda i: None)
    sync()
    _temporaries._TEMP_BYTES = limit
    assert not getattr(_temporaries._temps, "slots", None), "the references reused temporaries"

    got = run_all(ms, work, lambda i: None)  # back to back
    assert _temporaries._temps.slots, "no temporary was reused"
    checks = [("back to back", got)]
    if cuda:
        streams = [torch.cuda.Stream() for _ in range(3)]
        checks.append(("three streams in turn", run_all(ms, work, lambda i: streams[i % 3])))
    results, errors = [None, None], []
    turns = Turns(2) if cuda and not args.gloo else None  # NCCL (gloo's collectives do not block the GPU)

    def thread(t):
        try:
            s = torch.cuda.Stream() if cuda else None
            turn = (lambda: turns.of(t)) if turns else contextlib.nullcontext
            results[t] = run_all((ms, ms_other)[t], work, lambda i: s, turn)
        except BaseException as e:  # re-raised below, in the main thread
            errors.append(e)
    ts = [threading.Thread(target=thread, args=(t,)) for t in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    checks += [("thread 0 of 2", results[0]), ("thread 1 of 2", results[1])]
    sync()
    for what, res in checks:
        for (name, _, _), r, g in zip(work, ref, res):
            same(g, r, f"{name}, {what}")
    if rank == 0:
        print(f"{len(checks)} schedules x {len(work)} calls match the fresh-allocation references")
        print("PASS run_temporaries")


if __name__ == "__main__":
    main()
