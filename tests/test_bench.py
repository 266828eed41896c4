"""The benchmark command runs on the CPU (2 ranks, its small shape) and
writes its table: every case, both of our layers, the path the overlapped
one took, PyTorch's TP MLP baseline and every variant's host µs. Numbers are
not judged here (speed is measured on the GPUs); the baseline block is checked
against a single-process MLP."""
import json
import math
import subprocess
import sys

import pytest


def test_bench_command_runs_on_cpu(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--device", "cpu", "--nproc=2", "--iters", "1",
                        "--warmup", "1", "--batch", "2", "--cases", "ag_gemm,gemm_rs,mlp,mlp_bulk",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["batch"] == 2
    rows = {row["case"]: row for row in data["rows"]}
    assert set(rows) == {"ag_gemm", "gemm_rs", "mlp", "mlp_bulk"}
    for case, row in rows.items():
        assert row["ours"] > 0 and row["ours_overlap"] > 0, (case, row)
        assert row["path"] == "overlap", (case, row)  # the CPU transport overlaps every size
    for case in ("ag_gemm", "gemm_rs"):
        assert rows[case]["sequential"] > 0 and rows[case]["limit"] > 0
    md = (out / "bench.md").read_text()
    assert "| ag_gemm |" in md and "## Targets" in md
    assert rows["ag_gemm"]["norm_gbps"] > 0 and rows["ag_gemm"]["copy_gbps"] > 0
    assert rows["ag_gemm"]["copy_same_gbps"] > 0
    checked = {(t["target"], t["row"].split()[0]) for t in data["targets"]}
    for case in ("ag_gemm", "gemm_rs", "mlp", "mlp_bulk"):  # every row: not slower than without overlap
        assert ("not slower than without overlap (ours / ours_overlap)", case) in checked
    for case, row in rows.items():  # every timed variant has its host µs, from the same samples
        timed = {k for k, v in row.items() if k in row["host_us"]}
        assert {"ours", "ours_overlap"} <= set(row["host_us"]) and timed == set(row["host_us"]), (case, row)
        assert all(v > 0 for v in row["host_us"].values()), (case, row["host_us"])
    for case in ("ag_gemm", "gemm_rs"):
        assert "sequential" in rows[case]["host_us"] and "torch_mlp" not in rows[case]
    for case in ("mlp", "mlp_bulk"):  # PyTorch's TP MLP block: timed, and ours against it
        row = rows[case]
        assert row["torch_mlp"] > 0 and row["host_us"]["torch_mlp"] > 0
        assert math.isfinite(row["speedup_vs_torch_mlp"]) and row["speedup_vs_torch_mlp"] > 0
        assert math.isfinite(row["lnmlp_vs_torch_mlp"]) and row["lnmlp_vs_torch_mlp"] > 0
        assert "ours_graphed_no_overlap" not in row and "torch_mlp_graphed" not in row  # no --graphs
        assert ("eager: MLP step not slower than PyTorch's TP MLP (torch_mlp / ours_overlap)", case) in checked
    assert ("eager: not slower than PyTorch's sequential path (sequential / ours_overlap)", "gemm_rs") in checked
    assert "## Host µs per call" in md and "| torch_mlp host_us |" in md and "torch_mlp |" in md


def test_bench_fp8_tp_rows_run_on_cpu(tmp_path):
    """The TP=2 FP8 rows (FP8 with overlap against FP8 without, and against
    bf16 with overlap) are timed and judged; the two-GPU run measures them."""
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--device", "cpu", "--nproc=2", "--iters", "1",
                        "--warmup", "1", "--batch", "1", "--cases", "mlp", "--fp8-recipe", "current",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    row = data["rows"][0]
    for k in ("lnmlp_fp8", "lnmlp_fp8_overlap", "fp8_overlap_speedup", "fp8_vs_bf16"):
        assert math.isfinite(row[k]) and row[k] > 0, (k, row)
    assert row["host_us"]["lnmlp_fp8_overlap"] > 0
    judged = {t["target"]: t for t in data["targets"] if "FP8" in t["target"]}
    assert len(judged) == 2 and all(t["need"] in (1.25, 1.5) for t in judged.values()), judged


def test_bench_refuses_graphs_on_cpu():
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--device", "cpu", "--graphs"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--graphs needs --device cuda" in r.stderr and "CUDA graphs" in r.stderr, r.stderr


def _torch_mlp_rank(rank, store_path, out_path):
    """One of 2 gloo ranks: TorchTPMLP (its shards of full weights) forward +
    backward against the same MLP computed whole in this process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from transformer_engine_c.benchmarks.mlp import TorchTPMLP

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        T, H, N = 8, 6, 10
        g = torch.Generator().manual_seed(3)
        full = {k: torch.randn(*s, generator=g, dtype=torch.float64)
                for k, s in (("x", (T, H)), ("dy", (T, H)), ("gamma", (H,)), ("beta", (H,)), ("w1", (N, H)),
                             ("b1", (N,)), ("w2", (H, N)), ("b2", (H,)))}
        block = TorchTPMLP(H, N, dist.group.WORLD, torch.float64, torch.device("cpu"))
        cols, rows = slice(rank * N // 2, (rank + 1) * N // 2), slice(rank * T // 2, (rank + 1) * T // 2)
        with torch.no_grad():
            block.norm.weight.copy_(full["gamma"])
            block.norm.bias.copy_(full["beta"])
            block.fc1.weight.copy_(full["w1"][cols])
            block.fc1.bias.copy_(full["b1"][cols])
            block.fc2.weight.copy_(full["w2"][:, cols])
            block.fc2_bias.copy_(full["b2"])
        x = full["x"][rows].clone().requires_grad_()
        y = block(x)
        y.backward(full["dy"][rows])
        xr = full["x"].clone().requires_grad_()
        w1 = full["w1"].clone().requires_grad_()
        h = F.gelu(F.linear(F.layer_norm(xr, (H,), full["gamma"], full["beta"]), w1, full["b1"]), approximate="tanh")
        ref = F.linear(h, full["w2"], full["b2"])
        ref.backward(full["dy"])
        errs = [float((y - ref[rows]).abs().max()), float((x.grad - xr.grad[rows]).abs().max()),
                float((block.fc1.weight.grad - w1.grad[cols]).abs().max())]
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(errs, f)
    finally:
        dist.destroy_process_group()


def test_torch_mlp_baseline_matches_the_whole_mlp(tmp_path):
    """The baseline is a real TP MLP: on 2 ranks its output rows, input
    gradient and fc1 weight-gradient shard equal the single-process MLP's."""
    import torch.multiprocessing as mp

    mp.spawn(_torch_mlp_rank, args=(str(tmp_path / "store"), str(tmp_path / "errs")), nprocs=2, join=True)
    for rank in range(2):
        errs = json.loads((tmp_path / f"errs.{rank}").read_text())
        assert max(errs) < 1e-10, (rank, errs)


def test_torch_mlp_baseline_checks_its_shapes(monkeypatch):
    import torch
    import torch.distributed as dist

    from transformer_engine_c.benchmarks.mlp import TorchTPMLP

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # a TP group of 2, without one
    with pytest.raises(ValueError, match="n=7 must divide by the TP size 2"):
        TorchTPMLP(4, 7, None, torch.float32, torch.device("cpu"))


def test_timer_balances_the_order_of_its_rounds(tmp_path):
    """Timer.many: every round samples each variant once; over each block of
    as many rounds as variants, each variant takes each position once, and
    what runs just before a variant changes between blocks (a host-bound
    sample depends on it). The order depends on the seed and the round only:
    the same on every rank (the samples may be collectives)."""
    import torch
    import torch.distributed as dist

    from transformer_engine_c.benchmarks.overlap import Timer

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert isinstance(Timer(torch.device("cpu"), None, 0, 1).seed, int)  # agreed over the group
        runs = []
        for _ in range(2):  # two timers with one seed stand for two ranks
            seen = []
            fns = {n: (lambda n=n: seen.append(n)) for n in "abcd"}

            def missing():
                raise NotImplementedError
            fns["missing"] = missing  # left out of the rounds and the result
            host = {}
            res = Timer(torch.device("cpu"), None, warmup=1, iters=32, seed=7).many(fns, host=host)
            assert set(res) == set("abcd") and all(v >= 0 for v in res.values())
            assert set(host) == set("abcd") and all(v > 0 for v in host.values())  # µs per call, same samples
            assert seen[:4] == list("abcd")  # the warm-up, in order
            rounds = [seen[4 + 4 * i:8 + 4 * i] for i in range(32)]
            assert all(sorted(r) == list("abcd") for r in rounds)
            runs.append(rounds)
        assert runs[0] == runs[1]
        rounds = runs[0]
        for b in range(8):
            block = rounds[4 * b:4 * b + 4]
            assert all(sorted(r[pos] for r in block) == list("abcd") for pos in range(4))
        before_b = {r[r.index("b") - 1] for r in rounds if r.index("b") > 0}
        assert before_b == {"a", "c", "d"}  # b follows each of the others
    finally:
        dist.destroy_process_group()


def test_targets_name_each_issue_target_and_judge_it():
    from transformer_engine_c.benchmarks.overlap import targets

    def row(case, tp, shape=(8192, 4096, 12288), **v):
        return {"case": case, "tokens": shape[0], "hidden": shape[1], "n": shape[2], "tp": tp, **v}
    rows = [row("ag_gemm", 4, speedup_vs_ours=1.3, speedup_vs_limit=0.92, speedup_vs_sequential=1.49,
                gemm=0.30, ours_gemm=0.31, norm_gbps=3000.0, copy_gbps=4000.0, copy_same_gbps=3600.0),
            row("gemm_rs", 4, speedup_vs_ours=1.2, speedup_vs_sequential=1.6, speedup_vs_async_tp=1.8),
            row("mlp", 4, speedup_vs_ours=1.25),
            row("ag_gemm", 2, speedup_vs_ours=1.2, speedup_vs_sequential=1.16),
            row("mlp", 2, shape=(2048, 2048, 6144), speedup_vs_ours=0.99, speedup_vs_sequential=0.5,
                speedup_vs_torch_mlp=0.8, lnmlp_vs_torch_mlp=1.1, graphed_vs_torch_mlp=1.6),
            row("mlp", 2, speedup_vs_ours=1.1, speedup_vs_torch_mlp=1.2, graphed_vs_torch_mlp=1.2,
                graphed_overlap_speedup=1.04),
            row("gemm_rs", 2, shape=(1024, 1024, 4096), speedup_vs_sequential=0.9)]
    got = {(t["target"], t["row"]): t["met"] for t in targets(rows)}
    head = "8192x4096x12288"
    assert got[("TP=4: within 1.10x of the limit (limit / ours_overlap)", f"ag_gemm {head} tp=4")] is True
    assert got[("TP=4: faster than sequential", f"ag_gemm {head} tp=4")] is False
    assert got[("our GEMM against torch.matmul (gemm / ours_gemm)", f"ag_gemm {head} tp=4")] is True
    assert got[("norm kernel bandwidth against a copy's (4x its bytes)", f"ag_gemm {head} tp=4")] is False
    assert got[("norm kernel bandwidth against a copy's (its bytes)", f"ag_gemm {head} tp=4")] is True
    assert got[("TP=4: faster than sequential", f"gemm_rs {head} tp=4")] is True
    assert got[("TP=4: faster than async-TP", f"gemm_rs {head} tp=4")] is False
    assert got[("TP=4: MLP faster than without overlap", f"mlp {head} tp=4")] is True
    assert got[("TP=2: faster than sequential", f"ag_gemm {head} tp=2")] is True
    assert got[("not slower than without overlap (ours / ours_overlap)", "mlp 2048x2048x6144 tp=2")] is False
    # the headline's targets are not applied to other shapes, nor TP=4's to TP=2
    assert not any(t.startswith("TP=") and "graphed" not in t for t, r in got if "2048x2048x6144" in r)
    assert ("TP=4: faster than sequential", f"ag_gemm {head} tp=2") not in got
    # eager against PyTorch's sequential path and TP MLP at every shape; graphed at 2048x2048x6144
    small = "mlp 2048x2048x6144 tp=2"
    assert got[("eager: not slower than PyTorch's sequential path (sequential / ours_overlap)",
                "gemm_rs 1024x1024x4096 tp=2")] is False
    assert got[("eager: not slower than PyTorch's sequential path (sequential / ours_overlap)",
                f"ag_gemm {head} tp=2")] is True
    eager_mlp = "eager: MLP step not slower than PyTorch's TP MLP (torch_mlp / ours_overlap)"
    assert got[(eager_mlp, small)] is False
    assert got[(eager_mlp, f"mlp {head} tp=2")] is True
    assert got[("eager: LayerNormMLP not slower than PyTorch's TP MLP (torch_mlp / lnmlp)", small)] is True
    graphed = "TP=2: graphed MLP step against PyTorch's eager TP MLP (torch_mlp / the faster of ours_graphed_*)"
    assert got[(graphed, small)] is True
    assert (graphed, f"mlp {head} tp=2") not in got  # 1.2 would fail 1.5: it is not applied there
    # graphed with overlap against graphed without: at the headline shape only
    ub = [(c["row"], c["met"]) for c in targets(rows) if c["target"].startswith("TP=2: graphed with overlap")]
    assert ub == [(f"mlp {head} tp=2", True)]


def test_graphs_wiring_with_capture_stubbed(tmp_path, monkeypatch):
    """--graphs' variants on one CPU rank, with the CUDA-graph capture replaced
    by the module itself (capture itself runs on GPUs only): the mlp row gets
    every graphed variant, their host µs and ratios; our layers (with and
    without ub_* flags) pass tec.make_graphed_callables' capture checks."""
    import argparse

    import torch
    import torch.distributed as dist

    import transformer_engine_c as tec
    from transformer_engine_c.benchmarks import overlap as bench

    captured = []

    def capture(module, sample_args, **kw):
        captured.append((type(module).__name__, tuple(a.shape for a in sample_args)))
        return module
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        timer = bench.Timer(torch.device("cpu"), group, warmup=1, iters=2, batch=1)
        args = argparse.Namespace(dtype=torch.float32, graphs=True, fp8=None)
        row = bench.run_shape(tec, "mlp", 64, 32, 96, args, 0, 1, torch.device("cpu"), group, timer, None)
    finally:
        tec.destroy_ub()
        dist.destroy_process_group()
    assert sorted(captured) == [("TorchTPMLP", ((64, 32),))] + [("_TwoLayerMLP", ((64, 32),))] * 2
    for name in ("ours_graphed_no_overlap", "ours_graphed_overlap", "torch_mlp_graphed"):
        assert row[name] > 0 and row["host_us"][name] > 0, row
    for ratio in ("graphed_vs_torch_mlp", "graphed_vs_torch_graphed", "graphed_overlap_speedup"):
        assert math.isfinite(row[ratio]) and row[ratio] > 0, row


def test_bench_tp1_command_runs_on_cpu(tmp_path):
    """--tp1: every layer against its torch.nn build, both modes, one device."""
    out = tmp_path / "tp1"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--tp1", "--device", "cpu", "--shapes",
                        "8x16x32", "--iters", "1", "--warmup", "0", "--batch", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "tp1.json").read_text())
    got = {(row["layer"], row["mode"]) for row in data["rows"]}
    assert got == {(layer, mode) for layer in ("Linear", "LayerNormLinear", "LayerNormMLP", "MultiheadAttention",
                                               "ComposedBlock", "TransformerLayer")
                   for mode in ("fwd+bwd", "fwd (no_grad)")}
    assert all(row["ours_ms"] > 0 and row["torch_host_us"] > 0 for row in data["rows"])
    assert [a["mode"] for a in data["against_block"]] == ["fwd+bwd", "fwd (no_grad)"]
    assert all(a["host_ratio"] > 0 and a["ms_ratio"] > 0 for a in data["against_block"])
    md = (out / "tp1.md").read_text()
    assert "| LayerNormMLP | fwd+bwd | 8×16×32 |" in md and "| MultiheadAttention | fwd+bwd | 8×16×32 |" in md
    assert "| fwd (no_grad) | 8×16×32 |" in md  # the TransformerLayer-against-ComposedBlock table


def test_bench_tp1_against_block_pairs_the_rows():
    """TransformerLayer's rows meet ComposedBlock's of the same shape and mode, and nothing else."""
    from transformer_engine_c.benchmarks import tp1

    def row(layer, mode, tokens, ms, us):
        return dict(layer=layer, mode=mode, tokens=tokens, hidden=32, n=128, ours_ms=ms, ours_host_us=us)
    rows = [row("TransformerLayer", "fwd+bwd", 16, 2.0, 30.0), row("ComposedBlock", "fwd+bwd", 16, 1.0, 20.0),
            row("ComposedBlock", "fwd+bwd", 32, 9.0, 90.0), row("TransformerLayer", "fwd (no_grad)", 16, 1.0, 5.0),
            row("MultiheadAttention", "fwd (no_grad)", 16, 1.0, 1.0)]
    got = tp1.against_block(rows)
    assert [(a["mode"], a["tokens"], a["ms_ratio"], a["host_ratio"]) for a in got] == [("fwd+bwd", 16, 0.5, 1.5)]
    assert tp1.against_block(rows[:1]) == []


def test_bench_tp1_same_numbers_as_torch_layers():
    """The torch.nn builds compute what our layers compute (the comparison is of like with like)."""
    import torch

    import transformer_engine_c as tec
    from transformer_engine_c.benchmarks import tp1

    torch.manual_seed(0)
    x = torch.randn(6, 16, dtype=torch.float64).float()
    for layer in ("Linear", "LayerNormLinear", "LayerNormMLP"):
        ours, ref = tp1.build(tec, layer, 16, 32, torch.float32, torch.device("cpu"))
        assert torch.allclose(ours(x), ref(x), atol=1e-4, rtol=1e-4), layer
    x = torch.randn(6, 2, 512, dtype=torch.float64).float()  # 4 heads of 128: a qkv split in another order shows
    for layer in ("MultiheadAttention", "ComposedBlock"):
        ours, ref = tp1.build(tec, layer, 512, 128, torch.float32, torch.device("cpu"))
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-4, msg=layer)


def test_bench_tp1_transformer_layer_twin_computes_the_same():
    """The torch.nn TransformerLayer (TorchBlock with our parameter values)
    computes our TransformerLayer's function: output, input gradient and the
    qkv and fc1 weights' gradients, float32 on the CPU; hidden 512 has 4
    heads of 128, so a qkv split in another order would show."""
    import torch

    import transformer_engine_c as tec
    from transformer_engine_c.benchmarks import tp1

    torch.manual_seed(0)
    ours, ref = tp1.build(tec, "TransformerLayer", 512, 128, torch.float32, torch.device("cpu"))
    assert ref.heads == ours.self_attention.num_attention_heads_per_partition == 4
    x = torch.randn(12, 2, 512, dtype=torch.float64).float().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(12, 2, 512)
    y, y_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-4)
    qkv = ours.self_attention.layernorm_qkv
    torch.testing.assert_close(torch.cat([qkv.query_weight.grad, qkv.key_weight.grad, qkv.value_weight.grad]),
                               ref.qkv.weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.layernorm_mlp.fc1_weight.grad, ref.fc1.weight.grad, atol=1e-5, rtol=1e-4)
    causal = x.detach().clone()
    causal[-1] += 1.0  # the last position changes no earlier position's output, in either
    assert torch.equal(ref(causal)[:-1], ref(x.detach())[:-1]) and torch.equal(ours(causal)[:-1], ours(x)[:-1])


def test_bench_tp1_transformer_layer_row_runs_on_cpu(tmp_path):
    """--tp1 --layers TransformerLayer: its two rows at the given shape
    (TOKENSxHIDDENxFFN; sequences of min(TOKENS, 2048))."""
    out = tmp_path / "tp1"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--tp1", "--device", "cpu", "--layers",
                        "TransformerLayer", "--shapes", "16x32x128", "--iters", "1", "--warmup", "0", "--batch", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads((out / "tp1.json").read_text())["rows"]
    assert [(row["layer"], row["mode"], row["tokens"], row["hidden"], row["n"]) for row in rows] == [
        ("TransformerLayer", mode, 16, 32, 128) for mode in ("fwd+bwd", "fwd (no_grad)")]
    assert all(row["ours_ms"] > 0 and row["torch_ms"] > 0 and row["ours_host_us"] > 0 for row in rows)
    assert "| TransformerLayer | fwd+bwd | 16×32×128 |" in (out / "tp1.md").read_text()


def test_bench_tp1_refuses_a_bad_shape():
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--tp1", "--device", "cpu", "--shapes",
                        "8x16"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--shapes" in r.stderr
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--tp1", "--device", "cpu", "--layers",
                        "TransformerLayer", "--shapes", "3000x512x2048"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a multiple of the sequence length" in r.stderr, r.stderr


def test_bench_fp8_command_runs_on_cpu(tmp_path):
    """--fp8: every block and variant has a row and a status (ours in FP8 under
    both recipes runs on the CPU's emulation; torch._scaled_mm and the memory
    rows are CUDA only; torchao where installed); every target is listed with
    a status, and none is judged on CPU timings."""
    import importlib.util

    from transformer_engine_c.benchmarks import fp8

    out = tmp_path / "fp8"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--fp8", "--device", "cpu", "--shapes",
                        "16x32x64", "--iters", "1", "--warmup", "0", "--batch", "1", "--no-compile",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "fp8.json").read_text())
    rows = {row["block"]: row for row in data["rows"]}
    assert [row["block"] for row in data["rows"]] == list(fp8.BLOCKS)
    assert all((row["tokens"], row["hidden"], row["n"]) == (16, 32, 64) for row in data["rows"])
    have_torchao = importlib.util.find_spec("torchao") is not None
    for block in fp8.LAYER_BLOCKS:
        row = rows[block]
        assert list(row["status"]) == list(fp8.VARIANTS), row
        for name in ("ours", "ours_fp8_delayed", "ours_fp8_current", "torch"):
            assert row["status"][name] == "ok" and row["ms"][name] > 0 and row["host_us"][name] > 0, (block, name, row)
        assert row["status"]["torchao_fp8"] == ("ok" if have_torchao else "torchao not installed"), row
        assert ("torchao_fp8" in row["ms"]) == have_torchao
        assert row["ratios"]["fp8_delayed_vs_ours"] > 0 and row["ratios"]["fp8_current_vs_ours"] > 0
        assert (row["ratios"]["fp8_delayed_vs_torchao"] is not None) == have_torchao
    assert rows["gemm"]["status"]["ours_fp8_gemm"] == "ok" and rows["gemm"]["ms"]["ours_fp8_gemm"] > 0
    assert rows["gemm"]["status"]["torch_scaled_mm"].startswith("skipped: ")
    assert rows["gemm"]["ratios"] == {"fp8_gemm_vs_scaled_mm": None}
    assert all(s.startswith("skipped: ") for s in rows["memory"]["status"].values()) and rows["memory"]["status"]
    assert rows["graphs"]["status"] == {v: fp8.NO_GRAPHS for v in fp8.GRAPH_VARIANTS} and not rows["graphs"]["ms"]
    assert "CUDA graphs run on CUDA only" in r.stdout
    checks = data["targets"]
    assert [(t["target"], t["row"].split()[0]) for t in checks] == [(t[0], t[1]) for t in fp8.TARGETS]
    for t in checks:  # the CPU shape is none of the targets' shapes: each says why it was not judged
        assert t["status"] and t["status"] not in ("PASS", "MISS") and t["ratio"] is None, t
        if "torchao" in t["target"] and not have_torchao:
            assert t["status"] == "torchao not installed", t
    md = (out / "fp8.md").read_text()
    assert "## Targets" in md and "| LayerNormMLP | 16×32×64 |" in md and "the timings mean nothing" in r.stdout


def test_bench_fp8_targets_judge_each_target():
    """targets(): PASS / MISS on CUDA at the target's own shape (memory's is
    an upper bound), the failing variant's status where a ratio is missing,
    torchao's absence for its targets at every shape, nothing judged on the CPU."""
    from transformer_engine_c.benchmarks import fp8

    def row(block, shape, status=None, **ratios):
        return dict(block=block, tokens=shape[0], hidden=shape[1], n=shape[2], ratios=ratios,
                    status=status or {v: "ok" for v in fp8.VARIANTS + fp8.GEMM_VARIANTS})
    nie = "NotImplementedError: not yet"
    rows = [row("LayerNormLinear", fp8.BIG_LINEAR, fp8_delayed_vs_ours=1.6, fp8_current_vs_ours=1.3,
                fp8_delayed_vs_torchao=1.3, fp8_current_vs_torchao=1.2),
            row("LayerNormMLP", fp8.BIG_MLP, status={"ours": "ok", "ours_fp8_delayed": nie, "torchao_fp8": "ok"},
                fp8_delayed_vs_ours=None, fp8_delayed_vs_torchao=None),
            row("LayerNormMLP", fp8.SMALL, fp8_delayed_vs_ours=1.01, fp8_current_vs_ours=0.99),
            row("gemm", fp8.BIG_LINEAR, fp8_gemm_vs_scaled_mm=0.98),
            row("memory", fp8.BIG_MLP, extra_vs_bound=1.1)]
    got = {(t["target"], t["row"]): t["status"] for t in fp8.targets(rows, cuda=True, have_torchao=True)}
    assert len(got) == len(fp8.TARGETS)
    lnl, mlp, small = "LayerNormLinear 8192x4096x12288", "LayerNormMLP 8192x4096x16384", "LayerNormMLP 2048x2048x6144"
    assert got[("LayerNormLinear fwd+bwd: FP8 DelayedScaling >= 1.5x our bf16", lnl)] == "PASS"
    assert got[("LayerNormLinear fwd+bwd: FP8 Float8CurrentScaling >= 1.4x our bf16", lnl)] == "MISS"
    assert got[("ours FP8 DelayedScaling >= 1.25x torchao float8 compiled", lnl)] == "PASS"
    assert got[("ours FP8 Float8CurrentScaling >= 1.25x torchao float8 compiled", lnl)] == "MISS"
    assert got[("LayerNormMLP fwd+bwd: FP8 DelayedScaling >= 1.55x our bf16", mlp)] == nie
    assert got[("ours FP8 DelayedScaling >= 1.25x torchao float8 compiled", mlp)] == nie
    assert got[("small shape: FP8 DelayedScaling >= 1.0x our bf16", small)] == "PASS"
    assert got[("small shape: FP8 Float8CurrentScaling >= 1.0x our bf16", small)] == "MISS"
    assert got[("small shape: FP8 DelayedScaling >= 1.0x our bf16", "LayerNormLinear 2048x2048x6144")] == \
        "not run: no LayerNormLinear 2048x2048x6144 row"
    assert got[("our FP8 GEMM >= 0.97x torch._scaled_mm", "gemm 8192x4096x12288")] == "PASS"
    memory = "memory: FP8 step's extra over bf16 <= one FP8 copy + transpose per weight"
    assert got[(memory, "memory 8192x4096x16384")] == "MISS"
    rows[-1]["ratios"]["extra_vs_bound"] = 0.7
    no_ao = fp8.targets(rows, cuda=True, have_torchao=False)
    assert {t["status"] for t in no_ao if "torchao" in t["target"]} == {"torchao not installed"}
    assert next(t for t in no_ao if t["target"] == memory)["status"] == "PASS"
    on_cpu = {t["status"] for t in fp8.targets(rows, cuda=False, have_torchao=True) if t["ratio"] is not None}
    assert on_cpu == {"not judged: CPU timing"}


def test_bench_fp8_variants_start_from_the_same_parameters():
    """Each recipe's layer is a twin of ours (same values); torchao's block,
    where torchao is installed, is the torch.nn block with float8 Linears."""
    import torch

    import transformer_engine_c as tec
    from transformer_engine_c.benchmarks import fp8, tp1

    torch.manual_seed(0)
    x = torch.randn(16, 32)
    for layer in fp8.LAYER_BLOCKS:
        ours, ref = tp1.build(tec, layer, 32, 64, torch.float32, torch.device("cpu"))
        twin = fp8.fp8_twin(tec, layer, 32, 64, torch.float32, torch.device("cpu"), ours)
        assert twin is not ours and torch.equal(twin(x), ours(x)), layer
        ao = fp8.load_torchao()
        if ao is not None:
            block = fp8.torchao_block(ao, ref, compile_it=False)
            assert any(type(m).__name__ == "Float8Linear" for m in block.modules()), layer
            assert not any(type(m).__name__ == "Float8Linear" for m in ref.modules()), layer
            y, want = block(x), ref(x)
            assert ((y - want).norm() / want.norm()).item() < 0.1, layer


def test_bench_compile_command_runs_on_cpu(tmp_path):
    """--compile: the block eager and compiled, ours and torch.nn's, FP8
    eager and compiled, on the CPU (the CUDA-only variants say so)."""
    out = tmp_path / "compile"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--compile", "--device", "cpu",
                        "--shapes", "32x64", "--iters", "1", "--warmup", "0", "--batch", "1", "--variants",
                        "torch,ours,ours_compiled,ours_reduce_overhead,ours_fp8,ours_fp8_compiled", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads((out / "compile.json").read_text())["rows"]
    st = row["status"]
    assert {n: st[n] for n in ("torch", "ours", "ours_compiled", "ours_fp8", "ours_fp8_compiled")} == \
        dict.fromkeys(("torch", "ours", "ours_compiled", "ours_fp8", "ours_fp8_compiled"), "ok"), st
    assert st["ours_reduce_overhead"] == "skipped: CUDA only"
    assert row["ratios"]["compiled_vs_ours_eager"] > 0 and row["ratios"]["fp8_compiled_vs_compiled"] > 0
    assert "| 32 × 64 |" in (out / "compile.md").read_text()


def test_compile_bench_compile_adds():
    """What compiling adds to each block's host time, and their ratio; none
    without the four variants, no ratio where torch's block gains nothing."""
    from transformer_engine_c.benchmarks import compile as cb

    host = {"ours": 100.0, "ours_compiled": 130.0, "torch": 50.0, "torch_compiled": 60.0}
    assert cb.compile_adds(host) == dict(ours=30.0, torch=10.0, ratio=3.0)
    assert cb.compile_adds({k: v for k, v in host.items() if k != "torch_compiled"}) is None
    assert cb.compile_adds(dict(host, torch_compiled=45.0))["ratio"] is None


def test_compile_bench_blocks_compute_the_same():
    """Our block and the torch.nn block compute the same function (like with like)."""
    import torch

    import transformer_engine_c as tec
    from transformer_engine_c.benchmarks import blocks

    torch.manual_seed(0)
    ours = blocks.OurBlock(tec, 64, 2, torch.float32, torch.device("cpu"))
    ref = blocks.TorchBlock(64, 2, torch.float32, torch.device("cpu"))
    blocks.copy_into(ours, ref)
    x = torch.randn(16, 2, 64)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-4, rtol=1e-4)


def test_bench_fp8_host_command_runs_on_cpu(tmp_path):
    """--fp8 --host: a row per layer and for the block, every variant's host
    µs and device ms, the ratios over bf16, and where the bf16 and FP8 steps'
    host time goes (categories summing to the step's host µs)."""
    out = tmp_path / "host"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--fp8", "--host", "--device", "cpu",
                        "--shapes", "16x32x64", "--block-shapes", "16x32", "--iters", "1", "--warmup", "0",
                        "--batch", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "fp8_host.json").read_text())
    assert [(row["layer"], row["shape"]) for row in data["rows"]] == [
        ("LayerNormLinear", "16x32x64"), ("Linear", "16x32x64"), ("LayerNormMLP", "16x32x64"), ("block", "16x32")]
    for row in data["rows"]:
        assert set(row["host_us"]) == {"bf16", "fp8_delayed", "fp8_current", "fp8_delayed_general"}
        assert min(row["host_us"].values()) > 0
        for v in ("fp8_delayed", "fp8_current", "fp8_delayed_general"):
            assert math.isclose(row["host_ratio"][v], row["host_us"][v] / row["host_us"]["bf16"])
            assert math.isclose(row["x"][v], row["ms"]["bf16"] / row["ms"][v])
        for v in ("bf16", "fp8_delayed"):
            where = row["where"][v]
            assert math.isclose(sum(where.values()), row["host_us"][v], rel_tol=1e-6), where
            assert where.get("engine calls", 0) > 0
        assert row["where"]["fp8_delayed"].get("FP8 bookkeeping", 0) > 0
    md = (out / "fp8_host.md").read_text()
    assert "| block | 16x32 |" in md and "where the host time goes" in r.stdout


def test_fp8_host_general_variant_runs_the_general_path(monkeypatch):
    """fp8_delayed_general turns the one-call steps off for its step only."""
    from transformer_engine_c.benchmarks import fp8_host as H
    from transformer_engine_c.module import _fp8_gemm

    seen = []
    step = H.general_path(lambda: seen.append(_fp8_gemm.ONE_CALL))
    step()
    assert seen == [False] and _fp8_gemm.ONE_CALL is True


def test_fp8_host_categories():
    """Each profiled function lands in the category its file or name says
    (the first that matches); an unknown one in "other"."""
    from transformer_engine_c.benchmarks import fp8_host as H

    assert H.category(("~", 0, "<built-in method transformer_engine_c._C.fp8_linear_fwd>")) == "engine calls"
    assert H.category(("~", 0, "<built-in method torch.empty>")) == "allocations"
    assert H.category(("~", 0, "<method 'run_backward' of 'torch._C._EngineBase' objects>")) == "autograd engine"
    assert H.category(("/x/transformer_engine_c/module/_fp8.py", 1, "fprop")) == "FP8 bookkeeping"
    assert H.category(("/x/transformer_engine_c/module/_fp8_gemm.py", 1, "fprop")) == "FP8 bookkeeping"
    assert H.category(("/x/transformer_engine_c/module/_steps.py", 1, "fprop")) == "layer steps"
    assert H.category(("/somewhere/else.py", 1, "f")) == "other"
