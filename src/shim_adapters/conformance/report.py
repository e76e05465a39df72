"""Conformance results: per check counts, minimised repros, JSON and a markdown table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

#: Checks whose failures mean a masker lets invalid output through.
SOUNDNESS_CHECKS = ("soundness", "gamma")
#: Every check, in report order.
CHECK_NAMES = ("soundness", "completeness", "no_dead_ends", "tokenizer_edges", "control_tokens",
               "gamma")

#: Failure classes ``--fail-on`` selects, the checks feeding each, and the exit-status bit each
#: sets (the exit status is the OR of the failing selected classes: 1 soundness, 2
#: completeness, 4 dead ends, 8 errors, 16 control tokens, 32 stale known bugs).
FAILURE_CLASSES: dict[str, tuple[int, tuple[str, ...]]] = {
    "soundness": (1, SOUNDNESS_CHECKS),
    "completeness": (2, ("completeness", "tokenizer_edges")),
    "dead-ends": (4, ("no_dead_ends",)),
    "errors": (8, ()),
    "control-tokens": (16, ("control_tokens",)),
    "stale-known-bugs": (32, ()),
}
#: What fails a run unless ``--fail-on`` says otherwise: every class but stale known bugs (a
#: sampled check may simply not meet a known bug; the report still lists it).
DEFAULT_FAIL_ON = ("soundness", "completeness", "dead-ends", "errors", "control-tokens")


def parse_fail_on(spec: "str | Sequence[str] | None") -> tuple[str, ...]:
    """``"soundness,errors"``, ``"all"`` (every class), ``"default"`` or a sequence of names."""
    if spec is None:
        return DEFAULT_FAIL_ON
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item == "all":
            out.extend(FAILURE_CLASSES)
        elif item == "default":
            out.extend(DEFAULT_FAIL_ON)
        elif item == "none":
            continue
        elif item.replace("_", "-") in FAILURE_CLASSES:
            out.append(item.replace("_", "-"))
        else:
            raise ValueError(f"unknown failure class {item!r} in --fail-on; choose from "
                             f"{', '.join(FAILURE_CLASSES)}, all, default or none")
    return tuple(dict.fromkeys(out))


#: The failure class each check's failures belong to.
FAILURE_CLASS_OF_CHECK = {check: name for name, (_bit, checks) in FAILURE_CLASSES.items()
                          for check in checks}


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
    #: The characters the token completes (with the prefix's unfinished UTF-8 bytes), when
    #: they decode: what a byte token inside a character really adds.
    added_text: str | None = None
    #: The token's own output bytes, hex: what known bugs are matched on (a byte token's
    #: display text ``b'\\xed'`` holds a backslash its bytes do not).
    token_hex: str | None = None

    @property
    def token_bytes(self) -> bytes | None:
        return None if self.token_hex is None else bytes.fromhex(self.token_hex)

    @property
    def token_str(self) -> str | None:
        """The token's bytes as text, None when they are not whole UTF-8 characters."""
        data = self.token_bytes
        if data is None:
            return None
        try:
            return data.decode()
        except UnicodeDecodeError:
            return None

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
    #: The check itself crashed: an error of the cell, never a verdict on the check's class.
    error: str | None = None
    #: The cell's wall-clock safety cap stopped the check before its work budget was done:
    #: an error of the cell ("incomplete"), never a pass.
    incomplete: str | None = None
    #: Failures matched to a known bug: bug id -> how many (each one is also in ``xfailed``).
    known: dict[str, int] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.error:
            return "ERROR"
        if self.not_run:
            return "n/a"
        if self.failed:
            return "FAIL"
        if self.incomplete:
            return "incomplete"
        if self.xfailed:
            return "xfail"
        return "pass"

    def add_known(self, bug: str, n: int = 1) -> None:
        """Count ``n`` failures matched to the known bug ``bug``."""
        self.xfailed += n
        self.known[bug] = self.known.get(bug, 0) + n

    def unaccepted_known(self, accepted: Sequence[str] = ()) -> list[str]:
        """The known bugs met here that the user did not acknowledge (they fail the class)."""
        return [bug for bug in self.known if bug not in accepted]

    def count(self, ok: bool) -> bool:
        if ok:
            self.passed += 1
        return ok

    def add_failure(self, repro: Repro, known_bug: str | None, keep: int = 20) -> None:
        repro.known_bug = known_bug
        if known_bug:
            self.add_known(known_bug)
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
        if self.error:
            return "ERROR (crashed)"
        if self.not_run:
            return "n/a"
        text = f"{self.passed}/{self.passed + self.failed}"
        if self.xfailed:
            text += f" +{self.xfailed}xf"
        if self.incomplete:
            text += " incomplete"
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
    #: Known bugs expected in this cell (backend, version and construct match) that it did
    #: not reproduce: fixed upstream, or the check did not meet them.
    stale_known_bugs: list[str] = field(default_factory=list)
    #: Known bugs the sampled checks did not meet but their probe reproduced: id -> where.
    replayed_known_bugs: dict[str, str] = field(default_factory=dict)
    #: The code commit the cell ran under (a resumable run records it per cell).
    commit: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CellResult":
        """The inverse of ``asdict`` (as written to a report's JSON or a resume log)."""
        data = dict(data)
        data.pop("class_status", None)  # derived, written for readers of the JSON
        checks = {}
        for name, raw in data.pop("checks", {}).items():
            raw = {k: v for k, v in raw.items() if k != "status"}
            raw["failures"] = [Repro(**r) for r in raw.get("failures", [])]
            checks[name] = CheckResult(**raw)
        return cls(**data, checks=checks)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.backend, self.tokenizer, self.grammar)

    @property
    def soundness_failures(self) -> int:
        return sum(self.checks[c].failed for c in SOUNDNESS_CHECKS if c in self.checks)

    @property
    def is_error(self) -> bool:
        """A crash, a misconfiguration, a check that checked nothing or one the safety cap
        stopped: never a pass."""
        return bool(self.error and not self.unsupported) or bool(self.vacuous_checks) or \
            any(c.error or c.incomplete for c in self.checks.values())

    @property
    def vacuous_checks(self) -> list[str]:
        """Checks that ran but asserted nothing (and say no reason): a pass would be a lie."""
        return [name for name, c in self.checks.items()
                if c.not_run is None and c.error is None
                and c.passed + c.failed + c.xfailed == 0]

    def failing_classes(self, accepted: Sequence[str] = ()) -> list[str]:
        """The failure classes this cell fails (of all of them). A known bug met here fails
        its check's class unless its id is in ``accepted``."""
        return [name for name, status in self.class_status(accepted).items()
                if status == "failed"]

    def class_status(self, accepted: Sequence[str] = ()) -> dict[str, str]:
        """Per failure class: ``failed``, ``passed``, ``not run`` (no check of the class ran:
        the grammar did not compile, the check crashed or does not apply) or ``incomplete``
        (the safety cap stopped a check of the class). ``errors`` and ``stale-known-bugs``
        are ``failed`` or ``passed``."""
        out: dict[str, str] = {}
        for name, (_bit, checks) in FAILURE_CLASSES.items():
            if name == "errors":
                out[name] = "failed" if self.is_error else "passed"
                continue
            if name == "stale-known-bugs":
                out[name] = "failed" if self.stale_known_bugs else "passed"
                continue
            ran = [self.checks[c] for c in checks if c in self.checks
                   and not self.checks[c].not_run]
            if any(c.failed or c.unaccepted_known(accepted) for c in ran):
                out[name] = "failed"
            elif not [c for c in ran if not c.error]:
                out[name] = "not run"
            elif any(c.incomplete or c.error for c in ran):
                out[name] = "incomplete"
            else:
                out[name] = "passed"
        return out

    def known_bugs_met(self) -> dict[str, int]:
        """Every known bug met in this cell (by the sampled checks or replayed by its probe)."""
        out: dict[str, int] = {}
        for check in self.checks.values():
            for bug, n in check.known.items():
                out[bug] = out.get(bug, 0) + n
        return out

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.tokenizer}/{self.grammar}"


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
    commit: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DifferentialResult":
        return cls(**data)


@dataclass
class Report:
    profile: str
    meta: dict[str, Any] = field(default_factory=dict)
    cells: list[CellResult] = field(default_factory=list)
    differential: list[DifferentialResult] = field(default_factory=list)
    seconds: float = 0.0

    #: Failure classes that make :attr:`exit_code` non-zero.
    fail_on: tuple[str, ...] = DEFAULT_FAIL_ON
    #: Known bugs the user acknowledges (``--accept-known ID``): met, they are listed but do
    #: not fail their class. Any other known bug met fails its class.
    accept_known: tuple[str, ...] = ()

    @property
    def soundness_failures(self) -> int:
        return sum(c.soundness_failures for c in self.cells)

    def failing_classes(self) -> dict[str, list[str]]:
        """Failure class -> the cells failing it (every class, selected or not)."""
        out: dict[str, list[str]] = {}
        for cell in self.cells:
            for name in cell.failing_classes(self.accept_known):
                out.setdefault(name, []).append(cell.label)
        if not self.cells:
            out.setdefault("errors", []).append("no cell ran")
        if self.meta.get("remaining_cells"):  # a partial matrix is no pass
            out.setdefault("errors", []).append(
                f"{self.meta['remaining_cells']} planned cells not run yet")
        return out

    def exit_status(self, fail_on: "str | Sequence[str] | None" = None) -> int:
        """OR of the bits of the failing classes among ``fail_on`` (default: all but stale
        known bugs): 1 soundness, 2 completeness, 4 dead ends, 8 errors, 16 control tokens,
        32 stale known bugs. 0 only when every selected guarantee held in every cell."""
        selected = self.fail_on if fail_on is None else parse_fail_on(fail_on)
        code = 0
        for name in self.failing_classes():
            if name in selected:
                code |= FAILURE_CLASSES[name][0]
        return code

    def known_bugs_met(self) -> dict[str, tuple[list[str], int]]:
        """Known bug id -> (the cells meeting it, how many failures it excused)."""
        out: dict[str, tuple[list[str], int]] = {}
        for cell in self.cells:
            for bug, n in cell.known_bugs_met().items():
                cells, total = out.get(bug, ([], 0))
                out[bug] = (cells + [cell.label], total + n)
        return out

    @property
    def exit_code(self) -> int:
        """:meth:`exit_status` for the report's own ``fail_on`` selection."""
        return self.exit_status()

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
        for cell, raw in zip(self.cells, data["cells"]):
            raw["class_status"] = cell.class_status(self.accept_known)
        data["soundness_failures"] = self.soundness_failures
        data["failing_classes"] = self.failing_classes()
        data["known_bugs_met"] = self.known_bugs_met()
        data["exit_status"] = self.exit_code
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
        failing = self.failing_classes()
        lines += ["", f"Total time {self.seconds:.0f} s. Soundness failures (not known bugs): "
                  f"**{self.soundness_failures}**. Exit status **{self.exit_code}** (fail on "
                  f"{', '.join(self.fail_on) or 'nothing'}). Failing classes: "
                  + ("; ".join(f"{k} ({len(v)} cells)" for k, v in failing.items()) or "none")
                  + ". Cells show passed/checked assertions; `+Nxf` = known upstream bugs "
                  "(xfail).", ""]
        with_commit = any(cell.commit for cell in self.cells)
        header = ["backend", "tokenizer", "grammar", *CHECK_NAMES, "compile s", "total s"]
        if with_commit:
            header.append("commit")
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for cell in self.cells:
            if cell.error:
                status = "unsupported" if cell.unsupported else "ERROR"
                row = [cell.backend, cell.tokenizer, cell.grammar,
                       f"{status}: {cell.error[:80]}".replace("|", "/")] + \
                    [("" if cell.unsupported else "not run")] * (len(CHECK_NAMES) - 1)
            else:
                row = [cell.backend, cell.tokenizer, cell.grammar,
                       *(cell.checks[c].cell() if c in cell.checks else "-" for c in CHECK_NAMES)]
            row += [f"{cell.compile_seconds:.1f}", f"{cell.seconds:.1f}"]
            if with_commit:
                row.append(cell.commit or "?")
            lines.append("| " + " | ".join(row) + " |")
        lines += self._wall_time_lines()
        if self.differential:
            lines += ["", "## Differential (masks compared step by step along shared walks)", "",
                      "| tokenizer | grammar | backends | steps | tokens | disagreements | "
                      "verdicts (unsound/incomplete/undecided) |", "|---|---|---|---|---|---|---|"]
            for d in self.differential:
                verdicts = "; ".join(
                    f"{b}: {v['unsound']}/{v['incomplete']}/{v['undecided']}"
                    + (f" (+{v['refused_as_declared']} refused as declared)"
                       if v.get("refused_as_declared") else "")
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
        met = self.known_bugs_met()
        if met:
            lines += ["", "## Known bugs met (each fails its class unless accepted with "
                      "`--accept-known ID`)", "", "| known bug | cells | failures | accepted |",
                      "|---|---|---|---|"]
            for bug, (cells, n) in met.items():
                lines.append(f"| `{bug}` | {', '.join(cells)} | {n} | "
                             f"{'yes' if bug in self.accept_known else '**no**: fails'} |")
        not_run = [(cell, name) for cell in self.cells if not cell.unsupported
                   for name, status in cell.class_status(self.accept_known).items()
                   if status in ("not run", "incomplete")]
        if not_run:
            lines += ["", "## Classes not judged (never passed)", ""]
            lines += [f"- {cell.label} / {name}: "
                      f"{cell.class_status(self.accept_known)[name]}"
                      + (f" ({cell.error[:120]})" if cell.error else "")
                      for cell, name in not_run]
        stale = [(cell, b) for cell in self.cells for b in cell.stale_known_bugs]
        if stale:
            lines += ["", "## Known bugs that did not reproduce", ""]
            lines += [f"- {cell.label}: `{b}` expected here but not seen (fixed upstream? "
                      "then drop the entry)" for cell, b in stale]
        replayed = [(cell, b, where) for cell in self.cells
                    for b, where in cell.replayed_known_bugs.items()]
        if replayed:
            lines += ["", "## Known bugs the sampled checks missed, reproduced by their probe", ""]
            lines += [f"- {cell.label}: `{b}`: {where}" for cell, b, where in replayed]
        vacuous = [(cell, c) for cell in self.cells for c in cell.vacuous_checks]
        if vacuous:
            lines += ["", "## Checks that checked nothing (counted as errors)", ""]
            lines += [f"- {cell.label} / {c}: {'; '.join(cell.checks[c].notes) or 'no assertion'}"
                      for cell, c in vacuous]
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

    def _wall_time_lines(self) -> list[str]:
        """Per backend: how long its cells took (compile included), so a slow one is seen."""
        import statistics

        by_backend: dict[str, list[float]] = {}
        for cell in self.cells:
            if not cell.unsupported:
                by_backend.setdefault(cell.backend, []).append(cell.seconds)
        if not by_backend:
            return []
        lines = ["", "## Wall time per cell (seconds, compile included; unsupported cells "
                 "left out)", "", "| backend | cells | median | 90th pct | max | sum |",
                 "|---|---|---|---|---|---|"]
        for backend, times in by_backend.items():
            ordered = sorted(times)
            p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
            lines.append(f"| {backend} | {len(times)} | {statistics.median(times):.1f} | "
                         f"{p90:.1f} | {ordered[-1]:.1f} | {sum(times):.0f} |")
        return lines

    def to_junit_xml(self) -> str:
        """JUnit XML: one testcase per cell and check (failure: its repros; error: a crashed
        or vacuous cell; skipped: not applicable, with the reason)."""
        import xml.etree.ElementTree as ET

        suites = ET.Element("testsuites", name="shim-conformance")
        suite = ET.SubElement(suites, "testsuite", name=f"conformance-{self.profile}")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for cell in self.cells:
            names = list(cell.checks) or ["compile"]
            for name in names:
                counts["tests"] += 1
                case = ET.SubElement(suite, "testcase", classname=cell.label, name=name,
                                     time=f"{cell.checks[name].seconds if name in cell.checks else cell.compile_seconds:.3f}")
                check = cell.checks.get(name)
                if check is None:
                    if cell.unsupported:
                        counts["skipped"] += 1
                        ET.SubElement(case, "skipped", message=cell.error or "unsupported")
                    else:
                        counts["errors"] += 1
                        ET.SubElement(case, "error", message=cell.error or "no check ran")
                    continue
                unaccepted = check.unaccepted_known(self.accept_known)
                if check.error:
                    counts["errors"] += 1
                    ET.SubElement(case, "error", message=f"the check crashed: {check.error}")
                elif check.not_run:
                    counts["skipped"] += 1
                    ET.SubElement(case, "skipped", message=check.not_run)
                elif check.failed or unaccepted:
                    counts["failures"] += 1
                    bad = [r for r in check.failures
                           if not r.known_bug or r.known_bug in unaccepted]
                    node = ET.SubElement(case, "failure", message=f"{check.failed} failed of "
                                         f"{check.passed + check.failed}"
                                         + (f"; known bugs not accepted: {', '.join(unaccepted)}"
                                            if unaccepted else ""),
                                         type=FAILURE_CLASS_OF_CHECK.get(name, name))
                    node.text = "\n".join(r.one_line() for r in bad) or "\n".join(check.notes)
                elif check.incomplete:
                    counts["errors"] += 1
                    ET.SubElement(case, "error", message=f"incomplete: {check.incomplete}")
                elif name in cell.vacuous_checks:
                    counts["errors"] += 1
                    ET.SubElement(case, "error", message="checked nothing: "
                                  + ("; ".join(check.notes) or "no assertion"))
                if check.xfailed or check.notes:
                    out = ET.SubElement(case, "system-out")
                    out.text = "\n".join([r.one_line() for r in check.failures if r.known_bug]
                                         + check.notes)
            if cell.error and cell.checks and not cell.unsupported:
                counts["tests"] += 1
                counts["errors"] += 1
                case = ET.SubElement(suite, "testcase", classname=cell.label, name="run")
                ET.SubElement(case, "error", message=cell.error)
            for bug in cell.stale_known_bugs:
                counts["tests"] += 1
                case = ET.SubElement(suite, "testcase", classname=cell.label,
                                     name=f"known_bug:{bug}")
                if "stale-known-bugs" in self.fail_on:
                    counts["failures"] += 1
                    ET.SubElement(case, "failure", message=f"known bug {bug} did not reproduce",
                                  type="stale-known-bugs")
                else:
                    counts["skipped"] += 1
                    ET.SubElement(case, "skipped", message=f"known bug {bug} did not reproduce")
        for key, value in counts.items():
            suite.set(key, str(value))
        suite.set("time", f"{self.seconds:.2f}")
        return ET.tostring(suites, encoding="unicode")

    def write_junit(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('<?xml version="1.0" encoding="utf-8"?>\n' + self.to_junit_xml() + "\n")
        return path

    def write(self, directory: str | Path, stem: str | None = None) -> tuple[Path, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = stem or f"conformance-{self.profile}"
        json_path = directory / f"{stem}.json"
        md_path = directory / f"{stem}.md"
        json_path.write_text(self.to_json() + "\n")
        md_path.write_text(self.to_markdown())
        return json_path, md_path
