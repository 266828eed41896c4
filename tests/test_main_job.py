"""The main job (`python -m transformer_engine_c`): a short training run on 2 CPU
ranks, overlap off then on, with the head's weight a DistributedWeight. Checks
from its JSON that the loss falls, that the two runs agree, that every
overlapped path ran and the saved-tensor checker saw tensors and no alias; that
the same model on 1 rank follows the same curve (the gradient
synchronisation is right); that sizes the ranks do not divide are refused;
that examples/train.py trains; and that the job's own checks can fail."""
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from transformer_engine_c import __main__ as job
from transformer_engine_c import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "80", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "16",
         "--lr", "1e-2", "--device", "cpu"]


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                OMP_NUM_THREADS="1")


def run_job(tmp, *extra):
    proc = subprocess.run([sys.executable, "-m", "transformer_engine_c", *SMALL, "--out", str(tmp), *extra],
                          env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "PASS" in proc.stdout, proc.stdout[-4000:]
    with open(os.path.join(tmp, "main_job.json")) as f:
        return json.load(f), proc.stdout


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("job2"), "--nproc", "2", "--distributed-weight")


def mean(x):
    return sum(x) / len(x)


def test_main_job_trains_and_overlap_agrees(two_ranks):
    rep, out = two_ranks
    assert rep["ranks"] == 2 and rep["pass"]
    off, on = rep["runs"]
    assert (off["overlap"], on["overlap"]) == (False, True)
    for r in (off, on):
        losses = r["losses"]
        assert len(losses) == 80
        assert losses[0] > 0.8 * math.log(32), losses[:3]           # starts near ln(vocab)
        assert mean(losses[-10:]) < 0.5 * mean(losses[:10]), losses  # and falls well below it
        assert r["heldout_end"] < 0.5 * r["heldout_start"], (r["heldout_start"], r["heldout_end"])
        assert r["tokens_per_s"] > 0
        assert r["saved_tensors_checked"] > 0 and r["alias_violations"] == 0
        assert r["distributed_weight_gathers"] > 0
    # fp32 on 2 ranks: the runs differ only in the order of sums (tolerance 1e-3, step by step)
    assert train.curve_gap(on["losses"], off["losses"]) <= 1e-3
    assert abs(on["heldout_end"] - off["heldout_end"]) <= 1e-3 * off["heldout_end"]
    assert off["stats"] == {}
    st = on["stats"]
    # what the layers' flags ask for ran on each communicator, every step, and nothing fell back
    for name, key in (("qkv_fprop", "ag_overlap"), ("qkv_dgrad", "bulk_ag"), ("qkv_wgrad", "bulk_rs"),
                      ("proj_fprop", "rs_overlap"), ("proj_dgrad", "ag_overlap"), ("fc1_fprop", "ag_overlap"),
                      ("fc1_fprop", "bulk_ag"), ("fc1_dgrad", "rs_overlap"), ("fc2_fprop", "rs_overlap"),
                      ("fc2_dgrad", "ag_overlap")):
        assert st[name][key] >= 80, (name, key, st[name])
    assert all(s["ag_fallback"] == s["rs_fallback"] == 0 for s in st.values()), st
    assert "overlap on vs off" in out and "qkv_fprop" in out and "no saved tensor aliased" in out
    png = os.path.join(rep["args"]["out"], "main_job.png")
    if importlib.util.find_spec("matplotlib") is not None:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed: no PNG" in out and not os.path.exists(png)


def test_main_job_compiled_follows_the_eager_curve(tmp_path):
    """--compile: the same training under torch.compile (fullgraph), overlap
    off and on: both pass the job's own checks (every overlapped path ran,
    the checker saw saved tensors and no alias) and follow the eager run's
    curve step by step (fp32 on 2 CPU ranks: the same engine runs both)."""
    eager, _ = run_job(tmp_path / "eager", "--nproc", "2")
    compiled, out = run_job(tmp_path / "compiled", "--nproc", "2", "--compile")
    assert "under torch.compile" in out
    for e, c in zip(eager["runs"], compiled["runs"]):
        assert e["overlap"] == c["overlap"]
        assert train.curve_gap(c["losses"], e["losses"]) <= 1e-3, (c["losses"][:5], e["losses"][:5])
        assert c["saved_tensors_checked"] > 0 and c["alias_violations"] == 0
    st = compiled["runs"][1]["stats"]
    assert st["qkv_fprop"]["ag_overlap"] >= 80 and st["fc2_fprop"]["rs_overlap"] >= 80, st


def test_one_rank_follows_the_same_curve(two_ranks, tmp_path):
    """The tensor-parallel weights are slices of the same full weights, so 1
    rank and 2 ranks train the same model; their curves agree only if every
    gradient that sequence parallelism splits is summed (sync_grads) and the
    DistributedWeight head's gradient is reduce-scattered. The 1-rank run does
    not checkpoint: recomputation must not change the result either."""
    one, _ = run_job(tmp_path, "--nproc", "1", "--no-overlap", "--no-checkpoint")
    assert one["ranks"] == 1 and len(one["runs"]) == 1
    assert train.curve_gap(one["runs"][0]["losses"], two_ranks[0]["runs"][0]["losses"]) <= 1e-5


@pytest.mark.parametrize("argv, words", [
    (["--seq", "33"], "--seq 33 is not divisible by the 2"),
    (["--heads", "3", "--hidden", "48"], "--heads 3 is not divisible by the 2"),
    (["--ffn", "130", "--nproc", "4"], "--ffn 130 is not divisible by the 4"),
    (["--hidden", "30", "--heads", "4"], "--hidden 30 is not divisible by --heads 4"),
    (["--vocab", "33", "--distributed-weight"], "--vocab 33 is not divisible by the 2"),
    (["--period", "100"], "--period 100 must be <= --seq 64"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--compile", "reduce-overhead"], "--compile reduce-overhead needs CUDA GPUs"),
    (["--compile", "--distributed-weight"], "a DistributedWeight cannot be traced by torch.compile"),
])
def test_bad_sizes_are_refused(argv, words, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as e:
        job.parse(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_bad_sizes_refused_before_launch():
    proc = subprocess.run([sys.executable, "-m", "transformer_engine_c", "--device", "cpu", "--seq", "65"],
                          env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 2 and "--seq 65 is not divisible by the 2 tensor-parallel ranks" in proc.stdout
    assert "torch.distributed" not in proc.stdout  # refused by the job itself, no ranks started


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_example_trains():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                           os.path.join(ROOT, "examples", "train.py"), "--steps", "41", "--layers", "1",
                           "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "16", "--lr", "1e-2"],
                          env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) >= 3 and losses[-1] < 0.6 * losses[0], proc.stdout[-2000:]
    for name in ("qkv_fprop", "proj_fprop", "fc1_dgrad", "fc2_dgrad"):
        assert name in proc.stdout, proc.stdout[-2000:]


# ------------------------------------------ the job's own checks can fail

def test_falls_and_curve_gap_can_fail():
    assert train.falls([3.0] * 20 + [1.0] * 20)
    assert not train.falls([3.0] * 20 + [2.0] * 20)        # fell, but not to half
    assert not train.falls([3.0])                          # too short to tell
    a = [3.0 - 0.01 * i for i in range(50)]
    assert train.curve_gap(a, list(a)) == 0
    b = list(a)
    b[30] *= 1.01
    assert train.curve_gap(b, a) == pytest.approx(0.01)
    assert train.curve_gap(b, a, window=10) == pytest.approx(0.001, rel=0.1)
    with pytest.raises(ValueError, match="different lengths"):
        train.curve_gap(a, a[:-1])


def fake_run(overlap, losses, aliases=0, fallback=0, bulk=1):
    st = {"qkv_fprop": {"ag_overlap": 5, "rs_overlap": 0, "bulk_ag": bulk, "bulk_rs": 0, "ag_fallback": fallback,
                        "rs_fallback": 0},
          "fc2_fprop": {"ag_overlap": 0, "rs_overlap": 5, "bulk_ag": 0, "bulk_rs": 1, "ag_fallback": 0,
                        "rs_fallback": 0}} if overlap else {}
    return {"overlap": overlap, "losses": losses, "heldout_end": losses[-1], "alias_violations": aliases,
            "stats": st}


def test_judge_can_fail():
    good = [3.0] * 10 + [1.0] * 10
    ok, s = job.judge([fake_run(False, good), fake_run(True, good)], torch.float32)
    assert ok and s["agree"] and s["overlapped"]
    bad_cases = [
        [fake_run(False, good), fake_run(True, [x * 1.01 for x in good])],   # curves disagree
        [fake_run(False, [3.0] * 20), fake_run(True, [3.0] * 20)],           # loss did not fall
        [fake_run(False, good), fake_run(True, good, aliases=1)],            # the checker found an alias
        [fake_run(False, good), fake_run(True, good, fallback=1)],           # a layer fell back
        [fake_run(False, good), fake_run(True, good, bulk=0)],               # a path never ran
    ]
    for runs in bad_cases:
        assert not job.judge(runs, torch.float32)[0]
    # bf16 tolerates 1% on 10-step means, not 10%
    assert job.judge([fake_run(False, good), fake_run(True, [x * 1.01 for x in good])], torch.bfloat16)[0]
    assert not job.judge([fake_run(False, good), fake_run(True, [x * 1.1 for x in good])], torch.bfloat16)[0]


def test_generated_language():
    d = train.MarkovCopyData(vocab=16, seq=24, period=6, n_train=64, n_heldout=16, seed=3)
    assert d.train.shape == (64, 25) and d.heldout.shape == (16, 25)
    for s in (d.train, d.heldout):
        assert torch.equal(s[:, 6:], s[:, :-6])             # the copies
        steps = d.trans[s[:, :5], s[:, 1:6]]
        assert (steps > 0).all()                            # the chain's transitions
    assert not torch.equal(d.heldout, d.train[:16])        # another seed
    assert 0 < d.optimal_loss(d.heldout) < math.log(16) * 5 / 24


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (this machine has "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
def test_main_job_two_gpus(tmp_path):
    """bf16 on 2 GPUs (NCCL, CUDA IPC userbuffers): the loss falls, the two runs
    agree to the bf16 tolerance, every overlapped path ran, no alias."""
    proc = subprocess.run([sys.executable, "-m", "transformer_engine_c", "--device", "cuda", "--nproc", "2",
                           "--steps", "150", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "256",
                           "--vocab", "64", "--period", "16", "--distributed-weight", "--out", str(tmp_path)],
                          env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    with open(os.path.join(tmp_path, "main_job.json")) as f:
        rep = json.load(f)
    assert rep["pass"] and rep["args"]["dtype"] == "bfloat16"
    off, on = rep["runs"]
    for r in (off, on):
        assert mean(r["losses"][-10:]) < 0.5 * mean(r["losses"][:10])
        assert r["alias_violations"] == 0 and r["saved_tensors_checked"] > 0
    assert train.curve_gap(on["losses"], off["losses"], window=10) <= 5e-2
    counts = rep["checks"]["overlap_counts"]
    assert all(counts[k] > 0 for k in ("ag_overlap", "rs_overlap", "bulk_ag", "bulk_rs")), counts
    assert counts["ag_fallback"] == counts["rs_fallback"] == 0, counts
