"""The shipped source says what code is for, not which tracker item it came
from: no issue numbers ("issue 12", "issue #12", "Issue 29's") in the
package, csrc/, scripts/ and examples/. History belongs in commit messages
and docs/decisions.md."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ("transformer_engine_c", "csrc", "scripts", "examples")
SKIP_DIRS = {"__pycache__", "build"}
SKIP_EXT = {".so", ".o", ".pyc", ".json", ".pt", ".whl"}

ISSUE_NUMBER = re.compile(r"\bissues?[\s_-]*#?\s*\d+", re.IGNORECASE)


def issue_numbers(root, dirs=CHECKED):
    """(path relative to root, line number, line) of every line under `dirs`
    that names an issue by number."""
    hits = []
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            dirnames[:] = sorted(n for n in dirnames if n not in SKIP_DIRS and not n.startswith("."))
            for name in sorted(filenames):
                if os.path.splitext(name)[1] in SKIP_EXT:
                    continue
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    data = f.read()
                if b"\0" in data:  # binary
                    continue
                for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                    if ISSUE_NUMBER.search(line):
                        hits.append((os.path.relpath(path, root), i, line.strip()))
    return hits


def test_no_issue_numbers_in_the_source():
    hits = issue_numbers(ROOT)
    assert not hits, "issue numbers in the source (say what the code is for instead):\n" + "\n".join(
        f"{p}:{n}: {line}" for p, n, line in hits)


def test_the_matcher_catches_issue_numbers(tmp_path):
    for line in ["# issue 12", "see issue #12", "(Issue 29's targets)", "issue-26 work", "issues 3 and 4",
                 "/* fixed in ISSUE#7 */"]:
        assert ISSUE_NUMBER.search(line), line
    for line in ["an issue with the ranks", "tissue 5", "issued 3 copies", "the issue's 2 ranks"]:
        assert not ISSUE_NUMBER.search(line), line
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "ok.sh").write_text("# what this is for\n")
    (tmp_path / "scripts" / "bad.py").write_text('"""A helper."""\nx = 1  # the leftovers of issue 27\n')
    assert issue_numbers(str(tmp_path)) == [("scripts/bad.py", 2, "x = 1  # the leftovers of issue 27")]
