"""Shared by tests/test_reliability*.py: run a snippet in a fresh Python
process so that a crash (a signal) is seen as a test failure instead of
killing pytest, and report how it ended."""
import os
import signal
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_isolated(code, timeout=60, env=None):
    """Run `code` in `python -c`; returns (returncode, stdout, stderr).
    A negative returncode is the signal that killed it."""
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=e, cwd=ROOT)
    return p.returncode, p.stdout, p.stderr


def assert_clean(rc, out, err):
    """No signal, exit status 0."""
    if rc < 0:
        raise AssertionError(f"killed by {signal.Signals(-rc).name}\nstdout:\n{out}\nstderr:\n{err}")
    assert rc == 0, f"exit status {rc}\nstdout:\n{out}\nstderr:\n{err}"
