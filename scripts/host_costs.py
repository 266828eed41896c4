"""Host time to issue one call of the engine's wrappers and layers, against
PyTorch's equivalents (a diagnostic, not a test). One process, no
collectives (TP=1), small tensors so the GPU keeps up with the host:
what it prints is the CPU cost per call, the cost that bounds small shapes.

    python3 scripts/host_costs.py [--device cuda] [--rows 1024 --hidden 1024]
    python3 scripts/host_costs.py --compare-only --rounds 30

It ends with the layers against the same layers built from plain PyTorch
modules at [4, 16] (nn.Linear; nn.LayerNorm + nn.Linear; and for LayerNormMLP
nn.LayerNorm, nn.Linear, GELU, nn.Linear), the comparison the host-cost target
is set on (--compare-only: that alone), with the least and the median of the
interleaved rounds.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import transformer_engine_c as tec
from transformer_engine_c import _C, _engine
from transformer_engine_c._saved import prepare_for_saving


def per_call(fn, device, n=200, reps=7):
    """The least over reps of the host time of n back-to-back calls, in us per call
    (the least: other work on the host only ever adds)."""
    for _ in range(20):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return min(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="also a torch.profiler table of the LayerNormLinear step")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the layer comparison")
    ap.add_argument("--compare-only", action="store_true", help="only the layer comparison (the target's rows)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.compare_only:
        print_comparison(layer_comparison(device, dtype, args.rounds), device, args.rounds)
        return
    T, H = args.rows, args.hidden
    x = torch.randn(T, H, dtype=dtype, device=device)
    w = torch.randn(H, H, dtype=dtype, device=device)
    g, b = torch.ones(H, dtype=dtype, device=device), torch.zeros(H, dtype=dtype, device=device)
    xg = x.clone().requires_grad_()
    lin = tec.Linear(H, H, params_dtype=dtype, device=device)
    lnl = tec.LayerNormLinear(H, H, params_dtype=dtype, device=device)
    tlin = torch.nn.Linear(H, H, dtype=dtype, device=device)
    tln = torch.nn.LayerNorm(H, dtype=dtype, device=device)
    dy = torch.randn(T, H, dtype=dtype, device=device)
    ws = _engine.workspace(device, _C.gemm_workspace_bytes(_engine.device_code(device)))
    out = torch.empty(T, H, dtype=dtype, device=device)
    _, mu, rsigma = _engine.norm_fwd(x, g, b, 1e-5)
    dev, code = _engine.device_code(device), _engine.DTYPE_CODES[dtype]
    stream = _engine.stream_of(device)
    nbytes = ws.numel() if ws is not None else 0
    wsp = ws.data_ptr() if ws is not None else 0

    def raw_gemm():
        _C.gemm(dev, code, code, 0, 1, T, H, H, x.data_ptr(), H, w.data_ptr(), H, out.data_ptr(), H,
                0, 0, 0, wsp, nbytes, stream)

    def lnl_step():
        lnl(xg).backward(dy)

    def torch_step():
        tlin(tln(xg)).backward(dy)
    cases = [
        ("torch.empty", lambda: torch.empty(T, H, dtype=dtype, device=device)),
        ("stream_of", lambda: _engine.stream_of(device)),
        ("check_tensor", lambda: _engine.check_tensor(x, "A", ndim=2)),
        ("_C.gemm (raw)", raw_gemm),
        ("_engine.gemm", lambda: _engine.gemm(x, w, transb=True)),
        ("torch.matmul", lambda: torch.matmul(x, w.t())),
        ("_engine.norm_fwd", lambda: _engine.norm_fwd(x, g, b, 1e-5)),
        ("F.layer_norm", lambda: F.layer_norm(x, (H,), g, b)),
        ("prepare_for_saving", lambda: prepare_for_saving(x, w, g)),
        ("_engine.gemm dgrad", lambda: _engine.gemm(dy, w)),
        ("_engine.gemm wgrad + bias grad", lambda: _engine.gemm(dy, x, transa=True, bias_grad=True)),
        ("_engine.norm_bwd", lambda: _engine.norm_bwd(dy, x, mu, rsigma, g)),
    ]
    with torch.no_grad():
        cases += [("tec.Linear fwd (no_grad)", lambda: lin(x)), ("torch Linear fwd (no_grad)", lambda: tlin(x)),
                  ("tec.LayerNormLinear fwd (no_grad)", lambda: lnl(x)),
                  ("torch LN+Linear fwd (no_grad)", lambda: tlin(tln(x)))]
        res = [(name, per_call(fn, device)) for name, fn in cases]
    res += [("tec.Linear fwd (grad)", per_call(lambda: lin(xg), device)),
            ("tec.LayerNormLinear fwd (grad)", per_call(lambda: lnl(xg), device)),
            ("tec.LayerNormLinear fwd+bwd", per_call(lnl_step, device, n=50)),
            ("torch LN+Linear fwd+bwd", per_call(torch_step, device, n=50))]
    compare = layer_comparison(device, dtype, args.rounds)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                lnl_step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=45))
    print(f"host us per call, {device}, {dtype}, [{T}, {H}]")
    for name, us in res:
        print(f"  {name:36s} {us:8.1f}")
    print_comparison(compare, device, args.rounds)


def print_comparison(compare, device, rounds):
    print(f"\nlayers against the same layer built from plain PyTorch modules, {device}, [4, 16], us per call "
          f"over {rounds} interleaved rounds (least and median; target: ratio <= 1.25)")
    print(f"  {'case':36s} {'ours':>8s} {'torch':>8s} {'ratio':>7s} {'ours med':>9s} {'torch med':>9s} {'ratio':>7s}")
    for name, ours, ref, ours_med, ref_med in compare:
        print(f"  {name:36s} {ours:8.1f} {ref:8.1f} {ours / ref:7.2f} {ours_med:9.1f} {ref_med:9.1f} "
              f"{ours_med / ref_med:7.2f}")


def layer_comparison(device, dtype, rounds=15):
    """(case, our least us, torch's least, our median, torch's median) per
    layer call at [4, 16] over `rounds`, where the time is
    all host work: tec.Linear against nn.Linear, tec.LayerNormLinear against
    nn.LayerNorm + nn.Linear, tec.LayerNormMLP (ffn 64) against nn.LayerNorm,
    nn.Linear, GELU, nn.Linear; no-grad forward and forward+backward. Ours and
    torch's alternate round by round, so load on the machine hits both."""
    H = 16
    x = torch.randn(4, H, dtype=dtype, device=device)
    xg = x.clone().requires_grad_()
    dy = torch.randn(4, H, dtype=dtype, device=device)
    lin = tec.Linear(H, H, params_dtype=dtype, device=device)
    lnl = tec.LayerNormLinear(H, H, params_dtype=dtype, device=device)
    tlin = torch.nn.Linear(H, H, dtype=dtype, device=device)
    tln = torch.nn.LayerNorm(H, dtype=dtype, device=device)
    mlp = tec.LayerNormMLP(H, 4 * H, params_dtype=dtype, device=device)
    tfc1 = torch.nn.Linear(H, 4 * H, dtype=dtype, device=device)
    tfc2 = torch.nn.Linear(4 * H, H, dtype=dtype, device=device)

    def tmlp(a):  # TE's LayerNormMLP default: LayerNorm, fc1, tanh GELU, fc2
        return tfc2(F.gelu(tfc1(tln(a)), approximate="tanh"))

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run
    cases = [("Linear fwd (no_grad)", no_grad(lambda: lin(x)), no_grad(lambda: tlin(x))),
             ("LayerNormLinear fwd (no_grad)", no_grad(lambda: lnl(x)), no_grad(lambda: tlin(tln(x)))),
             ("Linear fwd+bwd", lambda: lin(xg).backward(dy), lambda: tlin(xg).backward(dy)),
             ("LayerNormLinear fwd+bwd", lambda: lnl(xg).backward(dy), lambda: tlin(tln(xg)).backward(dy)),
             ("LayerNormMLP fwd (no_grad)", no_grad(lambda: mlp(x)), no_grad(lambda: tmlp(x))),
             ("LayerNormMLP fwd+bwd", lambda: mlp(xg).backward(dy), lambda: tmlp(xg).backward(dy))]
    out = []
    for name, ours, ref in cases:
        times = ([], [])
        for r in range(rounds):  # alternating which goes first
            for i, fn in ((0, ours), (1, ref)) if r % 2 == 0 else ((1, ref), (0, ours)):
                times[i].append(per_call(fn, device, n=100, reps=1))
        out.append((name, min(times[0]), min(times[1]), statistics.median(times[0]), statistics.median(times[1])))
    return out


if __name__ == "__main__":
    main()
