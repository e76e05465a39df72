"""A resumable matrix run: each finished cell is appended to a JSON-lines log as it completes.

A matrix with SynCode at 50k-200k tokens runs for hours; a killed run must not lose its
finished cells. The log's first line is a header naming the settings every cell ran under (the
resolved profile, the γ switch, the library versions); a resume whose settings differ is
refused, so one report never mixes cells run under different settings. Each cell line records
the code commit it ran under. The report is assembled from the log, so it is the same whether
the run went through in one process or in ten.
"""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shim_adapters.conformance.report import CellResult, DifferentialResult
from shim_adapters.errors import ShimError

#: Bumped when a line's layout changes; a log of another format is refused.
LOG_FORMAT = 1


class ResumeMismatchError(ShimError):
    """The log was written under other settings than this run's."""


def code_commit() -> str:
    """The checkout's commit (``+dirty`` when tracked files differ), or ``unknown`` outside a
    git checkout (an installed package)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "plugins"],
                               cwd=here, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class CellLog:
    """The JSON-lines log of one resumable matrix run."""

    def __init__(self, path: Path, settings: dict[str, Any], commit: str):
        self.path = path
        self.settings = settings
        self.commit = commit
        self.cells: dict[tuple[str, str, str], CellResult] = {}
        self.differentials: dict[tuple[str, str], DifferentialResult] = {}
        self.started: str | None = None

    @classmethod
    def open(cls, path: str | Path, settings: dict[str, Any], *, resume: bool,
             commit: str | None = None) -> "CellLog":
        """A new log (``resume=False``: an existing file is refused, so nothing is overwritten
        by accident) or the existing one (``resume=True``), checked against ``settings``."""
        path = Path(path)
        log = cls(path, json.loads(json.dumps(settings, default=str)),
                  commit or code_commit())
        if path.exists() and path.stat().st_size:
            if not resume:
                raise ResumeMismatchError(
                    f"{path} exists: pass --resume to continue that run, --fresh to discard it, "
                    "or another --out/--stem")
            log._load()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            log.started = _now()
            log._append({"kind": "header", "format": LOG_FORMAT, "started": log.started,
                         "commit": log.commit, "settings": log.settings})
        return log

    def _load(self) -> None:
        # Split on "\n" only: str.splitlines() also breaks at U+0085 and U+2028, which a
        # repro's text may hold (written raw, ensure_ascii=False).
        lines = self.path.read_text(encoding="utf-8").split("\n")
        if lines and not lines[-1]:
            lines.pop()
        try:
            header = json.loads(lines[0])
        except (IndexError, json.JSONDecodeError) as exc:
            raise ResumeMismatchError(f"{self.path}:1: not a conformance cell log "
                                      f"({exc})") from None
        if header.get("kind") != "header" or header.get("format") != LOG_FORMAT:
            raise ResumeMismatchError(f"{self.path}:1: not a format-{LOG_FORMAT} conformance "
                                      "cell log header")
        diff = _differences(header["settings"], self.settings)
        if diff:
            raise ResumeMismatchError(
                f"{self.path} was written under other settings; refusing to mix cells. "
                f"Differences (log vs this run): {'; '.join(diff)}. Start a new log (another "
                "--out or --stem) or restore those settings")
        self.started = header.get("started")
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # the process died while writing its last line:
                    # drop it, so the next cell starts a line of its own
                    self.path.write_text("".join(f"{kept}\n" for kept in lines[:-1]),
                                         encoding="utf-8")
                    break
                raise ResumeMismatchError(f"{self.path}:{number}: not JSON") from None
            if entry.get("kind") == "cell":
                cell = CellResult.from_dict(entry["cell"])
                self.cells[cell.key] = cell
            elif entry.get("kind") == "differential":
                d = DifferentialResult.from_dict(entry["differential"])
                self.differentials[(d.tokenizer, d.grammar)] = d

    def _append(self, entry: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
            fh.flush()

    def add_cell(self, cell: CellResult, commit: str | None = None) -> None:
        """Record a finished cell (under this process's commit unless given)."""
        cell.commit = cell.commit or commit or self.commit
        self.cells[cell.key] = cell
        self._append({"kind": "cell", "finished": _now(), "cell": asdict(cell)})

    def add_differential(self, d: DifferentialResult, commit: str | None = None) -> None:
        d.commit = d.commit or commit or self.commit
        self.differentials[(d.tokenizer, d.grammar)] = d
        self._append({"kind": "differential", "finished": _now(), "differential": asdict(d)})

    def commits(self) -> dict[str, int]:
        """Commit -> how many logged cells ran under it."""
        out: dict[str, int] = {}
        for cell in self.cells.values():
            out[cell.commit or "?"] = out.get(cell.commit or "?", 0) + 1
        return out

    def import_report(self, report_json: str | Path, provenance: str,
                      settings: dict[str, Any] | None = None, replace: bool = False) -> int:
        """Take the cells and differentials of an earlier report (JSON), each marked with
        ``provenance`` (e.g. the commit the cells ran under). ``settings``: what that run ran
        under, when its report does not record them (reports before resumable runs); refused
        when they differ from the log's in anything but the profile file's name. Returns how
        many cells were added (cells already in the log are kept, unless ``replace``: then
        the report's cells and differentials replace them, e.g. a rerun done elsewhere)."""
        data = json.loads(Path(report_json).read_text(encoding="utf-8"))
        theirs = data.get("meta", {}).get("settings", settings)
        if theirs is None:
            raise ResumeMismatchError(f"{report_json} records no settings; say which profile "
                                      "file it ran under")
        theirs = json.loads(json.dumps(theirs, default=str))
        diff = [d for d in _differences(theirs, self.settings)
                if not d.startswith("profile_file:")]
        if diff:
            raise ResumeMismatchError(f"{report_json} ran under other settings; not imported: "
                                      + "; ".join(diff))
        added = 0
        for raw in data.get("cells", []):
            cell = CellResult.from_dict(raw)
            if replace or cell.key not in self.cells:
                self.add_cell(cell, commit=provenance)
                added += 1
        for raw in data.get("differential", []):
            d = DifferentialResult.from_dict(raw)
            if replace or (d.tokenizer, d.grammar) not in self.differentials:
                self.add_differential(d, commit=provenance)
        return added


def _differences(old: Any, new: Any, where: str = "") -> list[str]:
    """Human-readable paths where two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{where}.{key}" if where else key)
        return out
    return [] if old == new else [f"{where or 'value'}: {old!r} vs {new!r}"]

