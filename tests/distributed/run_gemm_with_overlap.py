"""Comm-GEMM overlap schedules against torch.distributed collectives + matmul,
and their failure paths. Run under torchrun (gloo on CPU):
  torchrun --nproc_per_node=2 tests/distributed/run_gemm_with_overlap.py --check numerics
Prints "PASS run_gemm_with_overlap" and exits 0 when every check passed."""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import transformer_engine_c as tec
import common
from common import close


def gather(x):
    out = torch.empty(x.shape[0] * dist.get_world_size(), *x.shape[1:], dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def reduce_scatter(x):
    """The reference sums in float32 (as the engine does), then rounds."""
    out = torch.empty(x.shape[0] // dist.get_world_size(), *x.shape[1:], dtype=torch.float32)
    dist.reduce_scatter_tensor(out, x.float().contiguous())
    return out.to(x.dtype)


def check_numerics(rank, tp):
    rows, K, N = 6, 32, 24
    S = rows * tp
    for dtype in (torch.float32, torch.bfloat16):
        comm = common.comm((S, max(K, N)), dtype, name=f"num_{dtype}")
        g = torch.Generator(common.DEV).manual_seed(1234)
        w = (torch.randn(N, K, generator=g) * 0.1 / K ** 0.5).to(dtype)      # shared
        bias = (torch.randn(N, generator=g) * 0.1).to(dtype)
        gl = torch.Generator(common.DEV).manual_seed(100 + rank)
        for it in range(3):  # reuse the buffer: the consumed/free handshakes
            x = torch.randn(rows, K, generator=gl).to(dtype)
            full = gather(x)
            # column fprop, input copied by the schedule
            out = comm.ag_gemm(x, w, bias=bias)
            close(out, full @ w.T + bias, f"ag_gemm {dtype} it{it}")
            assert torch.equal(comm.get_buffer(shape=(S, K)), full), "buffer does not hold the gathered input"
            # column fprop, input written straight into this rank's slot (the norm's path)
            slot = comm.get_buffer(local_chunk=True, shape=(rows, K))
            slot.copy_(x * 2)
            saved = torch.full((rows, K), float("nan")).to(dtype)
            out = comm.ag_gemm(slot, w, local_copy=saved)
            close(out, (full * 2) @ w.T, f"ag_gemm in-buffer {dtype} it{it}")
            del slot
            # the copy (made on the comm side) is complete once the call's output is usable
            assert torch.equal(saved, x * 2), "local_copy does not hold this rank's chunk"
            try:
                comm.ag_gemm(x, w, local_copy=comm.get_buffer(shape=(rows, K)))
                raise AssertionError("a local_copy inside the buffer was accepted")
            except ValueError as e:
                assert "local_copy lies in a communicator buffer" in str(e), e
            # row dgrad: gathered grad_output [S, N] @ W [N, K]
            dy = torch.randn(rows, N, generator=gl).to(dtype)
            out = comm.ag_gemm(dy, w, transb=False)
            close(out, gather(dy) @ w, f"ag_gemm dgrad {dtype} it{it}")
            # row fprop: GEMM + reduce-scatter
            a = torch.randn(S, K, generator=gl).to(dtype)
            out = comm.gemm_rs(a, w, bias=bias)
            close(out, reduce_scatter(a @ w.T) + bias, f"gemm_rs {dtype} it{it}")
            # column dgrad: dY [S, N] @ W [N, K]
            a2 = torch.randn(S, N, generator=gl).to(dtype)
            out = comm.gemm_rs(a2, w, transb=False)
            close(out, reduce_scatter(a2 @ w), f"gemm_rs dgrad {dtype} it{it}")
            # bulk all-gather overlapped with a GEMM on the caller's side
            comm.bulk_ag_start(x)
            other = a @ w.T
            got = comm.bulk_ag_finish()
            assert torch.equal(got, full), "bulk all-gather differs"
            close(other, a.float().matmul(w.float().T).to(dtype), "gemm during bulk_ag")
            # bulk reduce-scatter
            comm.bulk_rs_start(a)
            other = x @ w.T
            got = comm.bulk_rs_finish()
            close(got, reduce_scatter(a), f"bulk_rs {dtype} it{it}")
        st = comm.stats()
        for k, want in [("ag_overlap", 9), ("rs_overlap", 6), ("bulk_ag", 3), ("bulk_rs", 3)]:
            assert st[k] == want, f"stats {k}={st[k]}, expected {want}: {st}"
        assert st["non_overlap"] == 0, st
        # the buffer ranges: own first, then every peer's
        r = comm.buffer_ranges()
        assert len(r) == tp and r[0][0] == comm.buffer_ptr and all(n >= comm.buffer_bytes for _, n in r), r
        comm.close()
    # every region's descriptor closed once every rank mapped it (regions are memfds)
    dist.barrier()
    held = [fd for fd in os.listdir("/proc/self/fd") if _is_region(fd)]
    assert not held, f"region descriptors still open: {held}"


def check_fp8_partials(rank, tp):
    """gemm_rs with FP8 partials (TE's fp8_buf): each rank's partials are
    encoded with its own scale (a different one on every rank here), decoded
    by their owner with the scale_inv that travelled with them, and summed in
    float32 in rank order with the bias; the amax is the maximum over this
    rank's partials; half the bytes of bf16 partials are sent."""
    from transformer_engine_c import _fp8_engine as E
    from transformer_engine_c._comm_overlap import FP8Gemm, FP8Partials
    E4M3 = torch.float8_e4m3fn
    rows, K, N = 8, 64, 32
    S = rows * tp
    dev = common.DEV
    comm = common.comm((S, max(K, N)), torch.bfloat16, name="fp8_partials")
    g = torch.Generator(dev).manual_seed(7)
    w = torch.randn(N, K, generator=g, device=dev)  # shared
    bias = (torch.randn(N, generator=g, device=dev) * 0.5).bfloat16()
    gl = torch.Generator(dev).manual_seed(70 + rank)
    one = torch.ones(1, device=dev)
    qw, sw = E.quantize(w, E4M3, one * 4.0)[::2]
    for it in range(2):
        a = torch.randn(S, K, generator=gl, device=dev) * (1 + it)
        qa, sa = E.quantize(a, E4M3, one * 8.0)[::2]
        scale = one * (2.0 + rank + it)  # every rank its own: the scale_inv must travel with the bytes
        amax = torch.zeros(1, device=dev)
        before = comm.stats()
        out = comm.gemm_rs(qa, qw, bias=bias, fp8=FP8Gemm(E4M3, sa, E4M3, sw, torch.bfloat16),
                           fp8_partials=FP8Partials(E4M3, scale, 1 / scale, amax))
        after = comm.stats()
        # the reference: the float32 product, encoded with this rank's scale, decoded with its scale_inv
        p = E.fp8_gemm(qa, sa, E4M3, qw, sw, E4M3, out_dtype=torch.float32)
        dec = E.quantize(p, E4M3, scale)[0].view(E4M3).float() * (1 / scale)
        every = gather(dec.contiguous())  # [tp * S, N]: rank s's partials at rows s*S ...
        own_rows = slice(rank * rows, (rank + 1) * rows)
        acc = every[0:S][own_rows]
        for s in range(1, tp):
            acc = acc + every[s * S:(s + 1) * S][own_rows]
        want = (acc + bias.float()).bfloat16()
        wrong = acc * 0  # the same bytes decoded with the owner's scale_inv (one shared scale assumed)
        for s in range(tp):
            src = every[s * S:(s + 1) * S][own_rows] * (2.0 + s + it) / (2.0 + rank + it)
            wrong = wrong + src
        wrong = (wrong + bias.float()).bfloat16()
        if dev.type == "cpu":  # the CPU emulation is exact
            assert torch.equal(out, want), f"fp8 partials it{it}: {(out.float() - want.float()).abs().max()}"
            assert torch.equal(amax, p.abs().max().reshape(1)), f"amax {amax.item()} vs {p.abs().max().item()}"
        else:  # the FP8-output GEMM's own float32 products may round an element to the next FP8 value
            err = (out.float() - want.float()).abs() / (want.float().abs() + 0.5)
            assert err.max() < 0.15, f"fp8 partials it{it}: worst relative error {err.max().item()}"
            assert abs(amax.item() - p.abs().max().item()) <= 1e-3 * p.abs().max().item(), (amax, p.abs().max())
        if tp > 1:  # the check tells a shared-scale decode apart
            assert not torch.equal(out, wrong), "a decode with the owner's scale_inv gave the same output"
        chunk = (rows * N + 15) // 16 * 16 + 16  # FP8 bytes and the scale_inv after them
        sent = after["bytes_sent"] - before["bytes_sent"]
        assert sent == (tp - 1) * chunk, f"sent {sent} bytes, expected {(tp - 1) * chunk} (FP8 partials)"
    # refused before the operation starts (the communicator stays usable on every rank)
    for kw, word in [(dict(fp8_partials=FP8Partials(E4M3, one, one)), "needs FP8 chunk GEMMs"),
                     (dict(fp8=FP8Gemm(E4M3, sa, E4M3, sw, torch.float32),
                           fp8_partials=FP8Partials(E4M3, one, one)), "bfloat16 or float16"),
                     (dict(fp8=FP8Gemm(E4M3, sa, E4M3, sw, torch.bfloat16), fp8_partials=(E4M3, one, one)),
                      "must be an FP8Partials")]:
        try:
            comm.gemm_rs(qa if "fp8" in kw else a.bfloat16(), qw if "fp8" in kw else w.bfloat16(), **kw)
            raise AssertionError(f"gemm_rs accepted {kw}")
        except (ValueError, TypeError) as e:
            assert word in str(e), e
    close(comm.gemm_rs(qa, qw, fp8=FP8Gemm(E4M3, sa, E4M3, sw, torch.bfloat16)),
          reduce_scatter(E.fp8_gemm(qa, sa, E4M3, qw, sw, E4M3, out_dtype=torch.bfloat16)), "gemm_rs after refusals",
          tensorwise=True)
    comm.close()


def _is_region(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tec-region")
    except OSError:
        return False


def check_registry(rank, tp):
    common.init_ub((4 * tp, 16), tp, dtype=torch.float32,
                      ub_cfgs={"qkv_fprop": {"method": "ring_exchange", "num_splits": tp}})
    try:
        a, b = tec.get_ub("qkv_fprop"), tec.get_ub("fc2_fprop")
        assert a.name == "qkv_fprop" and a.method == "ring_exchange" and b.method == "pipeline"
        x = torch.randn(4, 16)
        w = torch.randn(8, 16)
        close(a.ag_gemm(x, w), gather(x) @ w.T, "registry ag_gemm")
        close(b.gemm_rs(gather(x), w), reduce_scatter(gather(x) @ w.T), "registry gemm_rs")
        sa, sb = a.stats(), b.stats()  # the schedule that ran, named, under each TE method
        assert sa["pull"] == 1 and sa["push"] == 0, sa  # ring_exchange
        assert sb["push"] == 1 and sb["pull"] == 0, sb  # pipeline
        try:
            tec.get_ub("nope")
            raise AssertionError("get_ub of an unknown name did not raise")
        except KeyError as e:
            assert "nope" in str(e)
    finally:
        tec.destroy_ub()
    for bad, word in [({"qkv_fprop": {"bogus_key": 1}}, "bogus_key"), ({"qkv_fprop": {"method": "x"}}, "method"),
                      ({"qkv_fprop": {"method": "ring_exchange", "num_splits": tp + 1}}, "num_splits"),
                      ({"nolayer": {}}, "nolayer")]:
        try:
            common.init_ub((4 * tp, 16), tp, ub_cfgs=bad)
            raise AssertionError(f"ub_cfgs {bad} did not raise")
        except ValueError as e:
            assert word in str(e), e


def check_timeout(rank, tp):
    """Rank tp-1 never arrives: the others raise CommTimeoutError in time."""
    comm = common.comm((4 * tp, 8), torch.float32, timeout=2.0, name="late")
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    late = tp - 1
    for op in ("ag_gemm", "gemm_rs"):
        if rank != late:
            t0 = time.monotonic()
            try:
                if op == "ag_gemm":
                    comm.ag_gemm(x, w)
                else:
                    comm.gemm_rs(torch.randn(4 * tp, 8), w)
                comm.synchronize()  # on CUDA a failed wait is reported here (waits run on the GPU)
                raise AssertionError(f"{op} returned although rank {late} never arrived")
            except tec.CommTimeoutError as e:
                dt = time.monotonic() - t0
                msg = str(e)
                assert dt < 2.0 + 3.0, f"{op}: timed out after {dt:.1f} s, limit 2 s"
                assert dt > 1.5, f"{op}: raised after {dt:.2f} s, before the 2 s timeout"
                assert f"peer {late}" in msg and "step" in msg and "'late'" in msg, msg
                assert isinstance(e, TimeoutError) and isinstance(e, RuntimeError)
            # the communicator is broken now and says so
            try:
                comm.ag_gemm(x, w)
                raise AssertionError("a broken communicator accepted work")
            except tec.CommTimeoutError as e:
                assert "earlier failure" in str(e), e
        dist.barrier()
        comm.close()
        comm = common.comm((4 * tp, 8), torch.float32, timeout=2.0, name="late")


def check_mismatch(rank, tp):
    # shapes of the buffer differ across ranks: caught at construction
    try:
        common.comm((4 * tp, 8 + rank), torch.float32, name="mm_ctor")
        raise AssertionError("mismatched buffers across ranks were accepted")
    except ValueError as e:
        assert "mismatched shapes" in str(e), e
    # fallback thresholds differ across ranks (they would take different paths): caught at construction
    try:
        common.comm((4 * tp, 8), torch.float32, name="mm_flops", min_chunk_flops=1e9 * (rank % 2))
        raise AssertionError("different min_chunk_flops across ranks were accepted")
    except (ValueError, RuntimeError) as e:
        assert "min_chunk_flops" in str(e), e
    # same buffer, different chunk shapes per rank: caught by the handshake
    comm = common.comm((8 * tp, 8), torch.float32, timeout=10.0, name="mm")
    rows = 4 + 2 * (rank % 2)
    t0 = time.monotonic()
    try:
        comm.ag_gemm(torch.randn(rows, 8), torch.randn(8, 8))
        comm.synchronize()  # on CUDA a failed wait is reported here (waits run on the GPU)
        raise AssertionError("mismatched chunk shapes across ranks were accepted")
    except ValueError as e:
        assert "mismatched shapes" in str(e) and "peer" in str(e), e
    assert time.monotonic() - t0 < 5.0, "mismatch detected only by the timeout"
    comm.close()


def check_small(rank, tp):
    comm = common.comm((2 * tp, 8), torch.float32, name="small")
    for fn in (lambda: comm.ag_gemm(torch.randn(3, 8), torch.randn(8, 8)),
               lambda: comm.gemm_rs(torch.randn(3 * tp, 8), torch.randn(8, 8)),
               lambda: comm.get_buffer(local_chunk=True, shape=(3, 8)),
               lambda: comm.bulk_rs_start(torch.randn(3 * tp, 8))):
        try:
            fn()
            raise AssertionError("an input larger than the buffer was accepted")
        except ValueError as e:
            assert "buffer too small for the input" in str(e), e
    # the engine checks too (bypassing the Python checks)
    try:
        x, w, out = torch.randn(16, 8), torch.randn(8, 8), torch.empty(16 * tp, 8)
        comm._ag_gemm(x.data_ptr(), 16, 8, 8, 0, 0, w.data_ptr(), 8, 1, out.data_ptr(), 8, 0, 0, 0, -1, -1, 0, 0, 0)
        raise AssertionError("the engine accepted an input larger than the buffer")
    except ValueError as e:
        assert "buffer too small for the input" in str(e), e
    view = comm.get_buffer()
    comm.close()
    comm.close()  # idempotent
    view.fill_(1.0)  # the mapping outlives close() while a view exists
    for fn in (lambda: comm.ag_gemm(torch.randn(1, 8), torch.randn(8, 8)), lambda: comm.get_buffer(),
               lambda: comm.stats() and comm.rank):
        try:
            fn()
            raise AssertionError("a closed communicator accepted work")
        except tec.EngineError as e:
            assert "closed" in str(e) and "'small'" in str(e), e
    del view
    dist.barrier()


def check_lifetime(rank, tp):
    """bulk_*_start on a temporary: the communicator keeps it alive until finish."""
    rows, cols = 256 * tp, 4096  # large enough that the comm side is still copying at finish
    comm = common.comm((rows, cols), torch.float32, name="lifetime")
    g = torch.Generator(common.DEV).manual_seed(rank)
    src = torch.randn(rows, cols, generator=g)
    want = reduce_scatter(src)
    comm.bulk_rs_start(src.clone())  # the only reference to the input is the communicator's
    torch.randn(rows, cols)          # give the allocator a chance to reuse freed memory
    close(comm.bulk_rs_finish(), want, "bulk_rs of a temporary")
    chunk = torch.randn(rows // tp, cols, generator=g)
    want = gather(chunk)
    comm.bulk_ag_start(chunk.clone())
    torch.randn(rows // tp, cols)
    assert torch.equal(comm.bulk_ag_finish(), want), "bulk_ag of a temporary"
    comm.close()


def check_close(rank, tp):
    """The collective close: unmap peers on every rank, meet, free."""
    comm = common.comm((4 * tp, 8), torch.float32, name="closing")
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    close(comm.ag_gemm(x, w), gather(x) @ w.T, "ag_gemm before close")
    assert len(comm.buffer_ranges()) == tp
    comm._unmap_peers(comm._stream())
    assert len(comm.buffer_ranges()) == 1, "peers still listed after unmapping"
    try:
        comm.ag_gemm(x, w)
        raise AssertionError("a communicator with unmapped peers accepted work")
    except tec.EngineError as e:
        assert "unmapped for closing" in str(e), e
    tec.close_comms([comm])
    assert comm.closed
    comms = [common.comm((4 * tp, 8), torch.float32, name=f"closing{i}") for i in range(3)]
    for c in comms:
        c.gemm_rs(torch.randn(4 * tp, 8), w)
    tec.close_comms(comms)
    assert all(c.closed for c in comms)
    tec.close_comms(comms)  # idempotent


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", default="numerics,fp8_partials,registry,mismatch,small,lifetime,close,timeout")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    common.setup(args.device)
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    for name in args.check.split(","):
        globals()[f"check_{name}"](rank, tp)
        dist.barrier()
        if rank == 0:
            print(f"ok {name} tp={tp}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("PASS run_gemm_with_overlap", flush=True)


if __name__ == "__main__":
    sys.exit(main())
