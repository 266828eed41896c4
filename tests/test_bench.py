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
