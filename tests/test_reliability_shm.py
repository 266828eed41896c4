"""The CPU transport's regions and the failures around their set-up.

* A region is a memfd, not a name in /dev/shm: a small /dev/shm (a private
  tmpfs in a private mount namespace: needs root or user namespaces; skipped
  with the reason otherwise) does not limit communicators.
* A rank that cannot make its region makes every rank raise MemoryError.
* A rank killed (SIGKILL or SIGTERM) at any stage of initialize_ub leaves
  nothing behind once every process of the job has exited."""
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from reliability_util import ROOT

DIST = os.path.join(ROOT, "tests", "distributed")


def _private_shm_possible():
    if not shutil.which("unshare"):
        return "no unshare(1) on this machine"
    p = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, text=True)
    if p.returncode:
        return f"cannot mount a private tmpfs on /dev/shm (needs privileges): {p.stderr.strip()}"
    return None


def _torchrun_cmd(script, nproc, port):
    return (f"{sys.executable} -m torch.distributed.run --nproc_per_node={nproc} --master_addr=127.0.0.1 "
            f"--master_port={port} {os.path.join(DIST, script)}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([ROOT, DIST] + [p for p in [e.get("PYTHONPATH")] if p])
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def test_small_dev_shm_does_not_limit_communicators():
    why = _private_shm_possible()
    if why:
        pytest.skip(why)
    code = ("import torch, transformer_engine_c as tec\n"
            "c = tec.CommOverlap((4096, 1024), torch.float32, tp_size=1)\n"  # 16 MiB of data in a 1 MiB /dev/shm
            "x, w = torch.randn(4096, 1024), torch.randn(8, 1024)\n"
            "torch.testing.assert_close(c.ag_gemm(x, w), x @ w.t(), rtol=1e-4, atol=1e-4)\n"  # K=1024 sums
            "c.close()\n"
            "print('16 MiB ok')\n")
    p = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c \"$0\"", code],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "16 MiB ok" in p.stdout, p.stdout


def test_creation_failure_on_one_rank_raises_on_every_rank():
    p = subprocess.run(_torchrun_cmd("run_create_fails.py", 2, free_port()).split(), capture_output=True, text=True,
                       env=_env(), timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "PASS run_create_fails" in out, out[-6000:]
    assert "rank 1: MemoryError" in out and "rank 0: MemoryError" in out, out[-6000:]


def _our_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("tec-")}


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("victim,sig,stage", [
    (0, "SIGKILL", "creating"), (0, "SIGKILL", "created"), (0, "SIGKILL", "mapped"),
    (0, "SIGTERM", "creating"), (0, "SIGTERM", "created"), (0, "SIGTERM", "mapped")])
def test_killed_rank_leaves_nothing(victim, sig, stage):
    """A rank ends by `sig` at `stage` of initialize_ub (run_kill_during_init.py)
    holding live regions; once every process of the job has exited, /dev/shm
    has nothing new (and the regions, having no names, went with them)."""
    before = _our_names()
    env = _env()
    env.update(TEC_TEST_KILL_RANK=str(victim), TEC_TEST_KILL_SIGNAL=sig, TEC_TEST_KILL_STAGE=stage)
    p = subprocess.Popen(_torchrun_cmd("run_kill_during_init.py", 2, free_port()).split(), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"run_kill_during_init hung:\n{out[-4000:]}")
    died = re.search(rf"rank {victim} dies at {stage} holding (\d+) region descriptors", out)
    assert died and int(died.group(1)) > 0, f"the victim did not die holding regions:\n{out[-4000:]}"
    pids = [int(m) for m in re.findall(r"rank \d pid (\d+)", out)]
    assert len(pids) == 2, out[-4000:]
    deadline = time.time() + 30
    while time.time() < deadline and not all(_gone(pid) for pid in pids):
        time.sleep(0.2)
    assert all(_gone(pid) for pid in pids), f"ranks still running: {pids}"
    left = _our_names() - before
    assert not left, f"left in /dev/shm after the job: {sorted(left)}"
