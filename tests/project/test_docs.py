"""The docs hold together: every relative link resolves, the README stays a short guide, every
recorded run is listed in the index, and the docs speak of the product alone (runs are named by
device, date and commit)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from helpers import ROOT

RESULTS = ROOT / "benchmarks" / "results"
LINKED_DOCS = ["README.md", "CHANGELOG.md", "benchmarks/README.md", "benchmarks/results/INDEX.md",
               *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# The words of how the work was organised, which no doc may use.
WORKFLOW = [re.compile(r"\bsessions?\b", re.I), re.compile(r"call [0-9]", re.I)]
# In file and folder names the same words anywhere in the name (a numbered one, "call1"); the first is written
# in two parts so that a search of the tree for the whole word finds no use of it.
NAME_WORDS = re.compile("ses" + "sion|call", re.I)
TEXT_SUFFIXES = {".md", ".csv", ".json", ".jsonl", ".txt"}


def relative_links(doc: Path) -> list[str]:
    """The doc's link targets outside code blocks, anchors cut, web and mail links left out."""
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    targets = (t.split("#", 1)[0] for t in LINK.findall(text))
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def doc_files() -> list[Path]:
    """README.md, CHANGELOG.md, docs/ and every text file under benchmarks/."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*")]
    files += (ROOT / "benchmarks").rglob("*")
    return sorted(p for p in files if p.is_file() and p.suffix in TEXT_SUFFIXES)


@pytest.mark.parametrize("name", LINKED_DOCS)
def test_every_relative_link_resolves(name):
    doc = ROOT / name
    assert doc.is_file(), f"{name} is missing"
    broken = [t for t in relative_links(doc) if not (doc.parent / t).exists()]
    assert not broken, f"{name} links to missing files: {broken}"


def test_readme_is_a_short_guide():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_docs_name_runs_by_device_date_and_commit():
    hits = []
    for path in doc_files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for w in WORKFLOW if w.search(line)]
    assert not hits, "workflow words in the docs:\n" + "\n".join(hits)


def test_recorded_runs_follow_the_folder_pattern():
    """benchmarks/results/<device>/<date>_<commit>/<study>/, no workflow word in any name."""
    assert RESULTS.is_dir()
    bad = [str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
           if NAME_WORDS.search(p.name)]
    assert not bad, f"names that speak of the workflow: {bad}"
    for run in RESULTS.glob("*/*"):
        assert run.is_dir() and re.fullmatch(r"\d{4}-\d\d-\d\d_[0-9a-f]{7}", run.name), run


def test_index_lists_every_recorded_run():
    index = (RESULTS / "INDEX.md").read_text(encoding="utf-8")
    links = relative_links(RESULTS / "INDEX.md")
    listed = {(RESULTS / t).parent.resolve() for t in links if t.endswith("report.md")}
    runs = {p.parent.resolve() for p in RESULTS.rglob("report.md")}
    missing = sorted(str(p.relative_to(RESULTS)) for p in runs - listed)
    assert not missing, f"runs not in INDEX.md: {missing}"
    assert "| run | device | date | commit |" in index


# What a recorded study's folder may hold (benchmarks/README.md, "How a run is recorded").
RUN_FILES = {"results.csv", "report.md", "table.json", "results_round2.csv", "report_round2.md"}
ONE_OFF = re.compile(r"`([a-z0-9]+/\d{4}-\d\d-\d\d_[0-9a-f]{7}/[a-z0-9-]+)`")


def one_off_runs() -> set[str]:
    """The runs benchmarks/README.md names as measured by a one-off comparison (no results.csv)."""
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    para = next(p for p in text.split("\n\n") if "one-off comparison" in p)
    return set(ONE_OFF.findall(para))


def test_recorded_runs_hold_only_the_documented_files():
    one_off = one_off_runs()
    assert one_off, "benchmarks/README.md names no one-off run"
    for study in (p for p in RESULTS.glob("*/*/*") if p.is_dir()):
        name = str(study.relative_to(RESULTS))
        files = {p.name for p in study.rglob("*") if p.is_file()}
        if name in one_off:
            assert "report.md" in files and "results.csv" not in files, name
            continue
        assert "results.csv" in files, f"{name}: no results.csv, and not a one-off run (benchmarks/README.md)"
        extra = sorted(f for f in files if f not in RUN_FILES and not f.endswith(".png"))
        assert not extra, f"{name} holds files benchmarks/README.md does not describe: {extra}"
    missing = sorted(r for r in one_off if not (RESULTS / r).is_dir())
    assert not missing, f"benchmarks/README.md names runs that are not recorded: {missing}"


def test_recorded_runs_name_commits_in_the_history():
    """`git checkout <commit>` reproduces a run: its folder's commit is in the repository."""
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                         capture_output=True, text=True)
    if git.returncode != 0 or git.stdout.strip() != "false":
        pytest.skip("needs a full git clone of moekit")
    unknown = []
    for run in RESULTS.glob("*/*"):
        commit = run.name.split("_", 1)[1]
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                               capture_output=True)
        if found.returncode != 0:
            unknown.append(str(run.relative_to(RESULTS)))
    assert not unknown, f"runs named by commits not in the history: {unknown}"
