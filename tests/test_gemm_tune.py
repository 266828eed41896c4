"""The GEMM algorithm sweep's choice (csrc/core/cuda/gemm_tune.h) is plain C:
build tests/c/gemm_tune_test.c with the C compiler and run it on any machine.
It catches the read-back that kept the heuristic's answer whatever the times
(a later, faster candidate must win)."""
import os
import shutil
import subprocess
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sweep_picks_the_fastest_candidate(tmp_path):
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    cc = shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine to build the test program with")
    exe = str(tmp_path / "gemm_tune_test")
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-O1", "-I", os.path.join(ROOT, "csrc", "core"),
                    os.path.join(ROOT, "tests", "c", "gemm_tune_test.c"), "-o", exe], check=True)
    proc = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "PASS gemm_tune_test" in proc.stdout, proc.stdout + proc.stderr
