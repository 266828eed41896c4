"""What splitting a GEMM into row chunks costs (as AG+GEMM's chunk GEMMs do),
alone and beside a device copy on another stream (a diagnostic, one GPU):
    python3 scripts/experiments/chunk_gemm.py
Prints, per shape, the time of one torch.matmul over all rows, of 2 and 4
equal row chunks and of a 1/4 + 3/4 split, each also with a 64 MB copy
running beside it."""
import torch

torch.manual_seed(0)
dev = "cuda"
dt = torch.bfloat16


def timeit(fn, reps=40):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps * 1e3


side = torch.cuda.Stream()
src = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
dst = torch.empty_like(src)


def with_copies(fn):
    def run():
        ev = torch.cuda.current_stream().record_event()
        side.wait_event(ev)
        with torch.cuda.stream(side):
            dst.copy_(src)  # 64 MB read + 64 MB write beside the GEMMs
        fn()
        torch.cuda.current_stream().wait_stream(side)
    return run


for M, K, N in ((8192, 4096, 6144), (8192, 4096, 3072), (16384, 8192, 12288), (16384, 8192, 6144)):
    a = torch.randn(M, K, dtype=dt, device=dev)
    w = torch.randn(N, K, dtype=dt, device=dev)
    out = torch.empty(M, N, dtype=dt, device=dev)
    wt = w.t()

    def split(parts):
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p)
        def run():
            for lo, hi in zip(bounds, bounds[1:]):
                torch.matmul(a[lo:hi], wt, out=out[lo:hi])
        return run
    cases = {"full": split([M]), "2 halves": split([M // 2] * 2), "4 quarters": split([M // 4] * 4),
             "1/4 + 3/4": split([M // 4, 3 * M // 4])}
    row = [f"{M}x{K}x{N}:"]
    for name, fn in cases.items():
        t0, t1 = timeit(fn), timeit(with_copies(fn))
        row.append(f"{name} {t0:7.1f} us (+copy {t1:7.1f})")
    copy_alone = timeit(lambda: dst.copy_(src))
    print(" | ".join(row) + f" | copy alone {copy_alone:.1f} us", flush=True)
