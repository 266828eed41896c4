"""The benchmark command runs on the CPU (2 ranks, its small shape) and
writes its table: every case, both of our layers, the path the overlapped
one took. Numbers are not judged here (speed is measured on the GPUs)."""
import json
import subprocess
import sys


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


def test_timer_balances_the_order_of_its_rounds(tmp_path):
    """Timer.many: every round samples each variant once; over each block of
    as many rounds as variants, each variant takes each position once, and
    what runs just before a variant changes between blocks (a host-bound
    sample depends on it). The order depends on the seed and the round only:
    the same on every rank (the samples may be collectives)."""
    import torch
    import torch.distributed as dist

    from transformer_engine_c.bench import Timer

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
            res = Timer(torch.device("cpu"), None, warmup=1, iters=32, seed=7).many(fns)
            assert set(res) == set("abcd") and all(v >= 0 for v in res.values())
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
    from transformer_engine_c.bench import targets

    def row(case, tp, shape=(8192, 4096, 12288), **v):
        return {"case": case, "tokens": shape[0], "hidden": shape[1], "n": shape[2], "tp": tp, **v}
    rows = [row("ag_gemm", 4, speedup_vs_ours=1.3, speedup_vs_limit=0.92, speedup_vs_sequential=1.49,
                gemm=0.30, ours_gemm=0.31, norm_gbps=3000.0, copy_gbps=4000.0, copy_same_gbps=3600.0),
            row("gemm_rs", 4, speedup_vs_ours=1.2, speedup_vs_sequential=1.6, speedup_vs_async_tp=1.8),
            row("mlp", 4, speedup_vs_ours=1.25),
            row("ag_gemm", 2, speedup_vs_ours=1.2, speedup_vs_sequential=1.16),
            row("mlp", 2, shape=(2048, 2048, 6144), speedup_vs_ours=0.99, speedup_vs_sequential=0.5)]
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
    assert not any(t.startswith("TP=") for t, r in got if "2048x2048x6144" in r)
    assert ("TP=4: faster than sequential", f"ag_gemm {head} tp=2") not in got
