"""The counts of one pytest run, for the last line of a scripts/gpu_validate.sh
part: "N passed, M failed, K skipped" (failed counts errors, skipped counts
xfails), from its --junitxml report, or from its -v log where pytest was
killed before it wrote the report; or from the ledger of tests/_cuda_state.py
(one line per test, over every process a part took), where a test that
failed while parts shared the GPU counts by its rerun alone, if RERUN is given.
    python3 scripts/pytest_counts.py REPORT.xml LOG
    python3 scripts/pytest_counts.py --ledger LEDGER [RERUN]
    python3 scripts/pytest_counts.py --failed LEDGER   (the node ids that failed or broke, one per line)
"""
import os
import re
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _cuda_state import read_ledger  # noqa: E402  (the ledger's one reader)

# A -v result line: "tests/x.py::test_y[cuda] PASSED   [ 12%]"
RESULT = re.compile(r"^\S+::.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def from_report(path):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = n["failures"] + n["errors"]
    return n["tests"] - failed - n["skipped"], failed, n["skipped"]


def from_log(path):
    seen = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0, "XFAIL": 0, "XPASS": 0}
    with open(path, errors="replace") as f:
        for line in f:
            m = RESULT.match(line)
            if m:
                seen[m.group(1)] += 1
    return seen["PASSED"] + seen["XPASS"], seen["FAILED"] + seen["ERROR"], seen["SKIPPED"] + seen["XFAIL"]


def counts(report, log):
    if os.path.exists(report) and os.path.getsize(report):
        return from_report(report)
    return from_log(log) if os.path.exists(log) else (0, 0, 0)


def failed(ledger):
    return [n for n, o in ledger.items() if o in ("failed", "broke")]


def ledger_counts(path, rerun_path=None):
    done = read_ledger(path)
    rerun = read_ledger(rerun_path) if rerun_path else {}
    first = failed(done)
    for n in first:
        if n in rerun:
            done[n] = rerun[n]
    n = {k: sum(o == k for o in done.values()) for k in ("passed", "skipped")}
    line = f"{n['passed']} passed, {len(failed(done))} failed, {n['skipped']} skipped"
    healed = [x for x in first if done[x] not in ("failed", "broke")]
    if rerun_path and first:
        line += f" ({len(first)} failed with the parts side by side; {len(healed)} of them passed alone)"
    return line


def main(argv):
    if argv[:1] == ["--ledger"] and len(argv) in (2, 3):
        print(ledger_counts(*argv[1:]))
        return 0
    if argv[:1] == ["--failed"] and len(argv) == 2:
        for nodeid in failed(read_ledger(argv[1])):
            print(nodeid)
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("{} passed, {} failed, {} skipped".format(*counts(*argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
