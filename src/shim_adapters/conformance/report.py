"""Conformance results: per check counts, minimised repros, JSON and a markdown table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Checks whose failures make the run exit non-zero: a masker that lets invalid output through.
SOUNDNESS_CHECKS = ("soundness",)
#: Every check, in report order.
CHECK_NAMES = ("soundness", "completeness", "no_dead_ends", "tokenizer_edges", "gamma")


@dataclass
class Repro:
    """One failure, minimised: replay ``prefix_token_ids`` then offer ``token_id``."""

    check: str
    kind: str
    backend: str
    tokenizer: str
    grammar: str
    prefix_text: str
    prefix_token_ids: list[int]
    token_id: int | None
    token_text: str | None
    detail: str
    #: Id of the known upstream bug this failure matches (then it is an xfail, not a fail).
    known_bug: str | None = None

    def one_line(self) -> str:
        tok = "EOS" if self.token_id is None else f"{self.token_id} {self.token_text!r}"
        bug = f" [known: {self.known_bug}]" if self.known_bug else ""
        return (f"{self.kind}: after {self.prefix_text!r} token {tok} — {self.detail}{bug}")


@dataclass
class CheckResult:
    name: str
    passed: int = 0
    failed: int = 0
    xfailed: int = 0
    #: Why the check could not run (or ran partly): never silent.
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    failures: list[Repro] = field(default_factory=list)
    seconds: float = 0.0
    #: Set when the check is not applicable at all (e.g. no controller modules).
    not_run: str | None = None

    @property
    def status(self) -> str:
        if self.not_run:
            return "n/a"
        if self.failed:
            return "FAIL"
        if self.xfailed:
            return "xfail"
        return "pass"

    def count(self, ok: bool) -> bool:
        if ok:
            self.passed += 1
        return ok

    def add_failure(self, repro: Repro, known_bug: str | None, keep: int = 20) -> None:
        repro.known_bug = known_bug
        if known_bug:
            self.xfailed += 1
        else:
            self.failed += 1
        same = [r for r in self.failures if r.kind == repro.kind and r.token_id == repro.token_id
                and r.known_bug == repro.known_bug]
        if same:
            # Keep the shortest prefix for each (kind, token): the minimal repro.
            if len(repro.prefix_text) < len(same[0].prefix_text):
                self.failures[self.failures.index(same[0])] = repro
            return
        if len(self.failures) < keep:
            self.failures.append(repro)

    def cell(self) -> str:
        if self.not_run:
            return "n/a"
        text = f"{self.passed}/{self.passed + self.failed}"
        if self.xfailed:
            text += f" +{self.xfailed}xf"
        return ("FAIL " if self.failed else "") + text


@dataclass
class CellResult:
    """One backend x tokenizer x grammar."""

    backend: str
    backend_version: str
    tokenizer: str
    grammar: str
    compile_seconds: float = 0.0
    seconds: float = 0.0
    checks: dict[str, CheckResult] = field(default_factory=dict)
    #: Compile refused (unsupported grammar) or crashed: the reason, recorded not skipped.
    error: str | None = None
    unsupported: bool = False

    @property
    def soundness_failures(self) -> int:
        return sum(self.checks[c].failed for c in SOUNDNESS_CHECKS if c in self.checks)


@dataclass
class DifferentialResult:
    tokenizer: str
    grammar: str
    backends: list[str]
    walks: int = 0
    steps: int = 0
    tokens_compared: int = 0
    disagreements: int = 0
    #: backend -> {"unsound": n, "incomplete": n, "undecided": n}
    verdicts: dict[str, dict[str, int]] = field(default_factory=dict)
    repros: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class Report:
    profile: str
    meta: dict[str, Any] = field(default_factory=dict)
    cells: list[CellResult] = field(default_factory=list)
    differential: list[DifferentialResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def soundness_failures(self) -> int:
        return sum(c.soundness_failures for c in self.cells)

    @property
    def exit_code(self) -> int:
        """Non-zero exactly when some masker allowed invalid output (not a known bug)."""
        return 1 if self.soundness_failures else 0

    def merge(self, other: "Report") -> None:
        self.cells.extend(other.cells)
        self.differential.extend(other.differential)
        self.seconds += other.seconds

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for cell, raw in zip(self.cells, data["cells"]):
            for name, check in cell.checks.items():
                raw["checks"][name]["status"] = check.status
        data["soundness_failures"] = self.soundness_failures
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, ensure_ascii=False, default=str)

    def to_markdown(self) -> str:
        lines = [f"# Conformance report: profile `{self.profile}`", ""]
        for key, value in self.meta.items():
            if isinstance(value, (list, tuple)):
                lines.append(f"- {key}:")
                lines.extend(f"  - {item}" for item in value)
            else:
                lines.append(f"- {key}: {value}")
        lines += ["", f"Total time {self.seconds:.0f} s. Soundness failures (not known bugs): "
                  f"**{self.soundness_failures}**. Cells show passed/checked assertions; "
                  "`+Nxf` = known upstream bugs (xfail).", ""]
        header = ["backend", "tokenizer", "grammar", *CHECK_NAMES, "compile s", "total s"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for cell in self.cells:
            if cell.error:
                status = "unsupported" if cell.unsupported else "ERROR"
                row = [cell.backend, cell.tokenizer, cell.grammar,
                       f"{status}: {cell.error[:80]}"] + [""] * (len(CHECK_NAMES) - 1)
            else:
                row = [cell.backend, cell.tokenizer, cell.grammar,
                       *(cell.checks[c].cell() if c in cell.checks else "-" for c in CHECK_NAMES)]
            row += [f"{cell.compile_seconds:.1f}", f"{cell.seconds:.1f}"]
            lines.append("| " + " | ".join(row) + " |")
        if self.differential:
            lines += ["", "## Differential (masks compared step by step along shared walks)", "",
                      "| tokenizer | grammar | backends | steps | tokens | disagreements | "
                      "verdicts (unsound/incomplete/undecided) |", "|---|---|---|---|---|---|---|"]
            for d in self.differential:
                verdicts = "; ".join(f"{b}: {v['unsound']}/{v['incomplete']}/{v['undecided']}"
                                     for b, v in d.verdicts.items())
                lines.append(f"| {d.tokenizer} | {d.grammar} | {', '.join(d.backends)} | "
                             f"{d.steps} | {d.tokens_compared} | {d.disagreements} | {verdicts} |")
        failures = [(cell, check, r) for cell in self.cells for check in cell.checks.values()
                    for r in check.failures]
        if failures:
            lines += ["", "## Failures and known bugs (minimised repros)", ""]
            for cell, check, r in failures[:200]:
                lines.append(f"- **{cell.backend} / {cell.tokenizer} / {cell.grammar} / "
                             f"{check.name}** {r.one_line()}")
        notes = [(cell, check, n) for cell in self.cells for check in cell.checks.values()
                 for n in check.notes]
        if notes:
            lines += ["", "## Notes", ""]
            seen = set()
            for cell, check, n in notes:
                key = (cell.backend, check.name, n)
                if key not in seen:
                    seen.add(key)
                    lines.append(f"- {cell.backend} / {cell.tokenizer} / {cell.grammar} / "
                                 f"{check.name}: {n}")
        diff_repros = [(d, r) for d in self.differential for r in d.repros]
        if diff_repros:
            lines += ["", "## Differential disagreements (shortest prefix, adjudicated)", ""]
            for d, r in diff_repros[:200]:
                lines.append(f"- {d.tokenizer} / {d.grammar}: after {r['prefix_text']!r} token "
                             f"{r['token']} allowed by {r['allowed_by']}, refused by "
                             f"{r['refused_by']} -> reference says **{r['verdict']}**")
        return "\n".join(lines) + "\n"

    def write(self, directory: str | Path, stem: str | None = None) -> tuple[Path, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = stem or f"conformance-{self.profile}"
        json_path = directory / f"{stem}.json"
        md_path = directory / f"{stem}.md"
        json_path.write_text(self.to_json() + "\n")
        md_path.write_text(self.to_markdown())
        return json_path, md_path
