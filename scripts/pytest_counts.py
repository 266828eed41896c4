"""The counts of one pytest run, for the last line of a scripts/gpu_validate.sh
part: "N passed, M failed, K skipped" (failed counts errors, skipped counts
xfails), from its --junitxml report, or from its -v log where pytest was
killed before it wrote the report.
    python3 scripts/pytest_counts.py REPORT.xml LOG
"""
import os
import re
import sys
import xml.etree.ElementTree as ET

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


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("{} passed, {} failed, {} skipped".format(*counts(*argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
