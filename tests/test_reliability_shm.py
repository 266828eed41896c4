"""/dev/shm exhaustion and stale segments.

* A small private /dev/shm (a tmpfs mounted in a private mount namespace:
  needs root or user namespaces; skipped with the reason otherwise): a
  communicator that does not fit is a MemoryError on every rank, no SIGBUS.
* A rank SIGKILLed during initialize_ub leaves its region names behind;
  the next creation in any process of the user removes them."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from reliability_util import ROOT, assert_clean, run_isolated

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


def test_single_process_small_shm_is_memory_error():
    why = _private_shm_possible()
    if why:
        pytest.skip(why)
    code = ("import torch, transformer_engine_c as tec\n"
            "try:\n"
            "    tec.CommOverlap((4096, 1024), torch.float32, tp_size=1)\n"
            "except MemoryError as e:\n"
            "    print('MemoryError:', e)\n"
            "c = tec.CommOverlap((64, 64), torch.float32, tp_size=1)\n"
            "print('small ok', c.ag_gemm(torch.ones(64, 64), torch.ones(2, 64))[0, 0].item())\n")
    p = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c \"$0\"", code],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "MemoryError: shm transport: /dev/shm has no room for a region of" in p.stdout, p.stdout
    assert "small ok 64.0" in p.stdout, p.stdout


def test_two_ranks_small_shm_every_rank_raises():
    why = _private_shm_possible()
    if why:
        pytest.skip(why)
    cmd = f"mount -t tmpfs -o size=12m tmpfs /dev/shm && {_torchrun_cmd('run_small_shm.py', 2, free_port())}"
    p = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, env=_env(), timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "PASS run_small_shm" in out, out[-6000:]
    assert "rank 1: MemoryError" in out and "rank 0: MemoryError" in out, out[-6000:]


def _our_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("tec-")}


def test_sigkilled_rank_segments_are_swept():
    """Rank 1 is SIGKILLed while initialize_ub waits in the handle exchange
    (after creating its regions); afterwards its names are in /dev/shm until
    a new communicator is created anywhere, which removes them."""
    before = _our_names()
    env = _env()
    env["TEC_TEST_KILL_RANK"] = "1"
    p = subprocess.Popen(_torchrun_cmd("run_kill_during_init.py", 2, free_port()).split(), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"run_kill_during_init hung:\n{out[-4000:]}")
    assert "rank 1 created, pid" in out, out[-4000:]
    pid = int(out.split("rank 1 created, pid ")[1].split()[0])
    deadline = time.time() + 30
    while time.time() < deadline:  # the killed rank is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    leaked = {n for n in _our_names() - before if f"-{pid}-" in n}
    assert leaked, f"expected the killed rank's names in /dev/shm (the test would prove nothing):\n{out[-3000:]}"
    rc, sout, serr = run_isolated("import torch, transformer_engine_c as tec\n"
                                  "tec.CommOverlap((8, 8), torch.float32, tp_size=1).close()\n")
    assert_clean(rc, sout, serr)
    still = leaked & _our_names()
    assert not still, f"stale names not removed: {sorted(still)}"
