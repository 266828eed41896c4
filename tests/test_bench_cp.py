"""`python -m transformer_engine_c.bench --cp` runs on two CPU ranks and
writes its table: every comm type's fwd+bwd time against one rank over the
whole sequence, and for p2p the serial ring, the exchange alone and the
overlap share. Numbers are not judged here."""
import json
import math
import subprocess
import sys


def test_bench_cp_runs_on_cpu(tmp_path):
    out = tmp_path / "cp"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--cp", "--device", "cpu", "--nproc=2",
                        "--tokens", "256", "--iters", "1", "--warmup", "0", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "cp.json").read_text())
    rows = {row["comm_type"]: row for row in data["rows"]}
    assert set(rows) == {"p2p", "all_gather", "a2a"} and data["meta"]["cp"] == 2
    for kind, row in rows.items():
        assert row["tokens"] == 256 and row["one_rank_ms"] > 0 and row["cp_ms"] > 0, row
        assert math.isclose(row["speedup"], row["one_rank_ms"] / row["cp_ms"]), row
    p2p = rows["p2p"]
    assert p2p["cp_serial_ms"] > 0 and p2p["exchange_ms"] > 0 and math.isfinite(p2p["overlap"]), p2p
    assert "| 256 | p2p |" in (out / "cp.md").read_text()
