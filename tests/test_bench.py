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
    assert "| ag_gemm |" in (out / "bench.md").read_text()


def test_timer_rotates_the_order_of_each_round(tmp_path):
    """Timer.many: round i starts at the i-th variant, so no variant always
    follows the same one (a host-bound sample depends on what ran before)."""
    import torch
    import torch.distributed as dist

    from transformer_engine_c.bench import Timer

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        seen = []
        fns = {n: (lambda n=n: seen.append(n)) for n in "abc"}

        def missing():
            raise NotImplementedError
        fns["missing"] = missing  # left out of the rounds and the result
        res = Timer(torch.device("cpu"), None, warmup=1, iters=4).many(fns)
        assert seen[:3] == list("abc")  # the warm-up, in order
        assert seen[3:] == list("abc" "bca" "cab" "abc")
        assert set(res) == set("abc") and all(v >= 0 for v in res.values())
    finally:
        dist.destroy_process_group()
