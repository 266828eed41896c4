"""A pytest plugin (loaded by tests/conftest.py) that keeps one broken CUDA
state from turning a whole run red, and a ledger a run can be resumed from.

After every test that left CUDA initialised, `probe()` checks the state the
next test inherits: no capture still open, the device synchronises, and the
default generator still draws (a capture that fails midway leaves it in its
capture mode, and every later random draw on the device raises). If the
state is broken, the run stops at once with exit code BROKEN_EXIT, naming
the test that broke it, which is counted as failed.

With TEC_TEST_LEDGER=FILE every finished test appends "outcome<TAB>nodeid"
to FILE (outcome: passed, failed, skipped, or broke), and a run started with
an existing FILE deselects the tests already in it: scripts/gpu_validate.sh
starts a fresh process on the remaining tests until none breaks the state,
and scripts/pytest_counts.py --ledger counts each test once.
"""
import os

import pytest

BROKEN_EXIT = 17
LEDGER_ENV = "TEC_TEST_LEDGER"


def probe():
    """None if the CUDA state is fit for the next test, else what is wrong.
    Draws one random number on the device and puts the generator's state
    back, so the tests' own draws do not change."""
    import torch
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph capture is still open on the current stream"
        torch.cuda.synchronize()
        state = torch.cuda.get_rng_state()
        torch.randn(1, device="cuda")
        torch.cuda.set_rng_state(state)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure here is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def read_ledger(path):
    """{nodeid: outcome} of a ledger (the last outcome of each test wins)."""
    done = {}
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                outcome, sep, nodeid = line.rstrip("\n").partition("\t")
                if sep:
                    done[nodeid] = outcome
    return done


class _Ledger:
    def __init__(self, path):
        self.path = path
        self.outcomes = {}

    def record(self, nodeid, outcome):
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"{outcome}\t{nodeid}\n")


_ledger = _Ledger(os.environ.get(LEDGER_ENV))


def pytest_collection_modifyitems(config, items):
    done = read_ledger(_ledger.path)
    if not done:
        return
    keep = [it for it in items if it.nodeid not in done]
    gone = [it for it in items if it.nodeid in done]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep


def pytest_runtest_logreport(report):
    seen = _ledger.outcomes.get(report.nodeid)
    if report.failed:
        outcome = "failed"
    elif report.skipped and report.when != "teardown":
        outcome = "skipped"
    else:
        outcome = "passed"
    # any failed phase fails the test; a skip in setup or call skips it
    if seen == "failed" or (seen == "skipped" and outcome == "passed"):
        return
    _ledger.outcomes[report.nodeid] = outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    outcome = _ledger.outcomes.pop(item.nodeid, "passed")
    problem = probe()
    if problem is None:
        _ledger.record(item.nodeid, outcome)
        return
    _ledger.record(item.nodeid, "broke")
    item.session.shouldstop = False
    pytest.exit(f"{item.nodeid} left the CUDA state broken ({problem}); it counts as failed, and the tests after "
                f"it need a fresh process", returncode=BROKEN_EXIT)
