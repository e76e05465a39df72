"""The repository says why, not when: no file names a working session or an issue by number.

Measured history lives in ``benchmarks/*.md``, dated and tied to a commit, and in the commit
log; a comment, docstring, report or doc that needs a measurement points at the benchmark
section instead. The check is the acceptance's own ``git grep``, so it needs a git checkout.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: "session" or "issue", a space, then a digit, in any case (as ``git grep -niE`` reads it)
HISTORY_PATTERN = "session [0-9]|issue [0-9]"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          timeout=120)


def _require_checkout() -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    inside = _git("rev-parse", "--show-toplevel")
    if inside.returncode != 0 or Path(inside.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not the top of a git checkout (an installed copy or an "
                    f"archive): the check reads the tracked files")


def test_no_session_or_issue_numbers_in_tracked_files() -> None:
    _require_checkout()
    found = _git("grep", "-n", "-i", "-E", HISTORY_PATTERN, "--", ".")
    assert found.returncode in (0, 1), f"git grep failed: {found.stderr}"
    hits = found.stdout.splitlines()
    assert not hits, (
        f"{len(hits)} line(s) name a session or an issue by number; say why in the present "
        f"tense, and put measured history in benchmarks/*.md by date and commit:\n"
        + "\n".join(hits[:40]))


def test_the_pattern_catches_what_it_is_meant_to(tmp_path: Path) -> None:
    """The check above passes on a clean tree only if the pattern can fail: it must find
    a session or issue number in any case and leave plain words alone."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    bad = "# measured in {} 12, see {} 13".format("Session", "Issue")  # not spelled out here
    (repo / "bad.py").write_text(bad + "\n")
    (repo / "good.py").write_text("# this session's sessions; an issue with issues\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    subprocess.run(["git", "-C", str(repo), "add", "bad.py", "good.py"], check=True, timeout=60)
    found = subprocess.run(["git", "-C", str(repo), "grep", "-n", "-i", "-E", HISTORY_PATTERN,
                            "--", "."], capture_output=True, text=True, timeout=60)
    assert found.stdout.splitlines() == [f"bad.py:1:{bad}"]
