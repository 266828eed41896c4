"""scripts/gpu_validate.sh's GPU parts (PART=k): together they list every
test file that may run on CUDA (it mentions cuda, or a test takes the device
fixture) and name only tests that exist; its --uncovered check reports a file
left out; scripts/pytest_counts.py reads a part's counts from pytest's report
or, where pytest was killed, from its -v log."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_validate.sh")


def script(*args):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60)


def test_parts_cover_every_test_file_that_may_run_on_cuda():
    r = script("--uncovered")
    assert r.returncode == 0 and not r.stdout, f"in no part of scripts/gpu_validate.sh:\n{r.stdout}{r.stderr}"


def test_parts_name_existing_tests_once():
    r = script("--parts")
    assert r.returncode == 0, r.stderr
    entries = [line.split(" ", 1) for line in r.stdout.splitlines()]
    assert sorted({k for k, _ in entries}) == ["1", "2", "3", "4", "5"], entries
    listed = [e for _, e in entries]
    assert len(listed) == len(set(listed)), sorted(e for e in listed if listed.count(e) > 1)
    for _, entry in entries:
        path, _, name = entry.partition("::")
        assert os.path.isfile(os.path.join(ROOT, path)), entry
        if name:
            with open(os.path.join(ROOT, path)) as f:
                assert re.search(rf"^def {re.escape(name)}\(", f.read(), re.M), entry
            assert path not in listed, f"{path} is listed whole and {entry} apart"


def test_a_file_left_out_is_reported(tmp_path):
    tests = tmp_path / "tests"
    (tests / "distributed").mkdir(parents=True)
    (tests / "distributed" / "test_new_runner.py").write_text(
        'def test_new_runner_on_gpus():\n    run_torchrun("run_new.py", 2, ["--device", "cuda"])\n')
    (tests / "test_new_kernel.py").write_text("def test_new_kernel(device):\n    pass\n")
    (tests / "test_plain.py").write_text("def test_plain():\n    pass\n")
    shutil.copy(os.path.join(ROOT, "tests", "test_kernels.py"), tests)  # in a part: not reported
    r = script("--uncovered", str(tmp_path))
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["tests/distributed/test_new_runner.py", "tests/test_new_kernel.py"], r.stdout


def test_part_counts_from_the_report_or_the_log(tmp_path):
    report, log = tmp_path / "part.xml", tmp_path / "pytest.log"
    report.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" '
                      'failures="2" skipped="3" tests="10"></testsuite></testsuites>')
    log.write_text("tests/test_a.py::test_x[cuda] PASSED      [ 25%]\n"
                   "tests/test_a.py::test_y[cuda-kw0 - a b] FAILED      [ 50%]\n"
                   "tests/test_a.py::test_z SKIPPED (no GPU)      [ 75%]\n"
                   "tests/test_a.py::test_w ERROR      [100%]\n"
                   "FAILED tests/test_a.py::test_y[cuda-kw0 - a b] - assert 0\n"
                   "SKIPPED [1] tests/test_a.py:3: no GPU\n")

    def counts(*paths):
        return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pytest_counts.py"), *map(str, paths)],
                              capture_output=True, text=True, check=True).stdout.strip()

    assert counts(report, log) == "4 passed, 3 failed, 3 skipped"
    assert counts(tmp_path / "killed.xml", log) == "1 passed, 2 failed, 1 skipped"


# tests/_cuda_state.py: a test that leaves the CUDA state broken stops its
# process at once, named; a run resumed from the ledger runs only the rest;
# the counts take each test once (the one that broke the state as failed).
_INNER_CONFTEST = '''
import sys
sys.path.insert(0, {tests!r})
import _cuda_state
from _cuda_state import pytest_collection_modifyitems, pytest_runtest_logreport, pytest_runtest_protocol

BROKEN = []
_cuda_state.probe = lambda: "the device is gone" if BROKEN else None  # what a failed capture leaves
'''
_INNER_TESTS = '''
import pytest
from conftest import BROKEN

def test_a():
    pass

def test_b_breaks_the_state():
    BROKEN.append(1)  # passes itself, but the next test would inherit a broken state

def test_c():
    assert 0

def test_d():
    pytest.skip("not here")

def test_e():
    pass
'''


def test_a_broken_state_stops_the_run_and_the_rest_runs_in_a_fresh_process(tmp_path):
    (tmp_path / "conftest.py").write_text(_INNER_CONFTEST.format(tests=os.path.join(ROOT, "tests")))
    (tmp_path / "test_inner.py").write_text(_INNER_TESTS)
    ledger = tmp_path / "ledger.txt"

    def pytest_run():
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TEC_TEST_LEDGER": str(ledger)})

    first = pytest_run()
    assert first.returncode == 17, first.stdout + first.stderr
    assert "test_inner.py::test_b_breaks_the_state left the CUDA state broken (the device is gone)" in first.stdout
    assert ledger.read_text().splitlines() == ["passed\ttest_inner.py::test_a",
                                               "broke\ttest_inner.py::test_b_breaks_the_state"]
    second = pytest_run()  # a fresh process: only the tests not yet run
    assert second.returncode == 1, second.stdout + second.stderr
    assert "1 failed, 1 passed, 1 skipped, 2 deselected" in second.stdout, second.stdout
    counts = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pytest_counts.py"), "--ledger",
                             str(ledger)], capture_output=True, text=True, check=True).stdout.strip()
    assert counts == "2 passed, 2 failed, 1 skipped"
    failed = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pytest_counts.py"), "--failed",
                             str(ledger)], capture_output=True, text=True, check=True).stdout.split()
    assert failed == ["test_inner.py::test_b_breaks_the_state", "test_inner.py::test_c"]
    # a rerun alone that passes turns a failure into a pass, and says so
    rerun = tmp_path / "rerun.txt"
    rerun.write_text("passed\ttest_inner.py::test_c\n")
    counts = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pytest_counts.py"), "--ledger",
                             str(ledger), str(rerun)], capture_output=True, text=True, check=True).stdout.strip()
    assert counts == "3 passed, 1 failed, 1 skipped (2 failed with the parts side by side; 1 of them passed alone)"


def test_the_cuda_state_probe_passes_a_usable_state():
    import _cuda_state  # conftest.py's plugin
    assert _cuda_state.probe() is None  # on the CPU, or on a GPU nothing broke
