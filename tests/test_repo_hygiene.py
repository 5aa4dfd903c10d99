"""The repository speaks of the project only: no machine paths, results/ as listed data, docs without a diary.

Every check reads the files git tracks (`git ls-files`), so a scratch file in a checkout
never fails it and a committed one always does:

- no absolute path of a particular machine (/work/, /tmp/, /root/, /home/, /farm/,
  /Users/) in README.md or under docs/, results/, notebooks/, jaxkv/, models/,
  pallas_kernels/;
- every file under results/ is listed in results/README.md (and every file listed
  there exists), at most MAX_RESULTS_FILES of them;
- docs/results/performance.md is a reference page of at most MAX_PERFORMANCE_LINES lines;
- no page in docs/ and no notebook narrates the work: no "session", no issue numbers
  ("#65", "[2/6]"), no citation of DESIGN.md (a file the repository does not contain).
"""
from __future__ import annotations

import json
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED_FOR_PATHS = ("README.md", "docs", "results", "notebooks", "jaxkv", "models", "pallas_kernels")
MAX_RESULTS_FILES = 80
MAX_PERFORMANCE_LINES = 300

# An absolute machine path: one of these roots right after a character that cannot end a
# path component or a host name. A relative path (`results/tmp/x`), a URL
# (`https://host/home/x`: the slash follows a host character) and a home-relative path
# (`~/.cache`) do not match; `file:///tmp/x`, `"/work/x"` and `(/home/x)` do.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|farm|Users)/")

NARRATION = {
    "a work session": re.compile(r"\bsessions?\b", re.I),
    # `#65`, not a heading (`# Title`), a link anchor (`page.md#methods`) or an entity (`&#38;`).
    "an issue number": re.compile(r"(?<![\w&/#])#\d+\b"),
    "an issue's place in a series": re.compile(r"\[\d+/\d+\]"),
    "DESIGN.md, which the repository does not contain": re.compile(r"DESIGN\.md"),
}
def _tracked(*paths: str) -> list[str]:
    """Repository-relative paths of the files git tracks under `paths`."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, tracked files unknown: {e}")
    return [p for p in out.decode().split("\0") if p]


def _text(path: str) -> str | None:
    """The file's text, or None for a binary file (a NUL byte: images and arrays, whose bytes match by chance)."""
    data = (ROOT / path).read_bytes()
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def test_no_machine_paths():
    found = []
    for path in _tracked(*SCANNED_FOR_PATHS):
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path}:{number}: {line.strip()[:120]}")
    assert not found, "absolute machine paths:\n" + "\n".join(found)


@pytest.mark.parametrize("text, matches", [
    ("see /work/probe/x.py", True), ("(/tmp/hyb/capture.npz)", True), ("rootdir: /root/x", True),
    ("file:///home/me/x", True), ('"/Users/me/x"', True), ("/farm/out", True),
    ("results/tmp/x", False), ("https://example.org/home/x", False), ("~/.cache/jaxkv/native", False),
    ("../tmp/x", False), ("the /tmp directory", False), ("work/tmp/", False),
])
def test_machine_path_pattern(text, matches):
    # The pattern itself: what it must flag and the look-alikes it must not.
    assert bool(MACHINE_PATH.search(text)) == matches


def _listed_results() -> set[str]:
    """The files named (in backticks) in the first cell of results/README.md's table rows, relative to results/."""
    listed = set()
    for line in (ROOT / "results" / "README.md").read_text().splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            listed.update(re.findall(r"`([^`]+)`", cells[1]))
    return listed


def test_results_are_listed_and_few():
    tracked = {p.removeprefix("results/") for p in _tracked("results")} - {"README.md"}
    assert len(tracked) + 1 <= MAX_RESULTS_FILES, f"results/ holds {len(tracked) + 1} files"
    listed = _listed_results()
    assert tracked - listed == set(), f"not listed in results/README.md: {sorted(tracked - listed)}"
    assert listed - tracked == set(), f"listed in results/README.md but not in results/: {sorted(listed - tracked)}"


def test_performance_page_is_short():
    lines = (ROOT / "docs" / "results" / "performance.md").read_text().splitlines()
    assert len(lines) <= MAX_PERFORMANCE_LINES, f"docs/results/performance.md has {len(lines)} lines"


def _prose(path: str) -> str:
    """A page's text; for a notebook, the source of its cells (not its outputs or metadata)."""
    if path.endswith(".ipynb"):
        return "\n".join("".join(cell["source"]) for cell in json.loads((ROOT / path).read_text())["cells"])
    return (ROOT / path).read_text()


@pytest.mark.parametrize("page", [p for p in _tracked("docs", "notebooks") if p.endswith((".md", ".ipynb"))])
def test_page_does_not_narrate(page):
    found = []
    for number, line in enumerate(_prose(page).splitlines(), 1):
        found += [f"{page}:{number}: {what}: {line.strip()[:120]}" for what, pattern in NARRATION.items()
                  if pattern.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text, what", [
    ("the eighteenth session's runs", "a work session"), ("see #65", "an issue number"),
    ("issue [2/6]", "an issue's place in a series"), ("as DESIGN.md says", "DESIGN.md, which the repository does not contain"),
])
def test_narration_patterns_flag(text, what):
    assert [w for w, pattern in NARRATION.items() if pattern.search(text)] == [what]


@pytest.mark.parametrize("text", ["# Title", "[methods](index.md#methods)", "&#38;", "x[1:2]", "a 2/6 share"])
def test_narration_patterns_pass(text):
    assert not any(pattern.search(text) for pattern in NARRATION.values())
