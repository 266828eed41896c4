"""The README's main command: it launches its own ranks, runs the block with
and without overlap, checks both against the float64 reference and says PASS."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_cpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-m", "transformer_engine_c", "--device", "cpu", "--nproc", "2",
                           "--steps", "1"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "PASS" in proc.stdout and "overlap on vs off" in proc.stdout, proc.stdout[-4000:]
    assert "ag_overlap=4, rs_overlap=4" in proc.stdout, proc.stdout[-4000:]
