"""pytest plugin: run conformance on *your* backend, tokenizer and grammars in CI, one line.

    pytest --shim-conformance=xgrammar --shim-tokenizer=./tokenizer.json \\
        --shim-grammar=grammars/order.lark --shim-grammar=grammars/id.regex

adds one test per grammar and failure class (soundness, completeness, dead-ends, errors,
control-tokens) that fails with the minimised repros; ``--shim-fail-on`` narrows the classes,
``--shim-eos`` names the EOS token of a bare tokenizer, ``--shim-profile`` picks ``fast`` or
``full``, ``--shim-report DIR`` keeps the JSON + markdown reports. The plugin is registered
through the ``pytest11`` entry point of ``shim-adapters``; the ``shim_conformance`` fixture runs
a cell from a test and fails it on any selected failure class.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shim_adapters.backends.registry import backends as installed
from shim_adapters.conformance.known_bugs import UnknownKnownBugError, check_known_ids
from shim_adapters.conformance.report import FAILURE_CLASSES, parse_fail_on
from shim_adapters.conformance.runner import run_conformance


def pytest_addoption(parser) -> None:
    group = parser.getgroup("shim-conformance", "SHIM masker conformance")
    group.addoption("--shim-conformance", metavar="BACKEND", default=None,
                    help="run conformance for this registered backend (enables the plugin)")
    group.addoption("--shim-tokenizer", default="default",
                    help="tokenizer: offline name, tokenizer.json, directory or .model file")
    group.addoption("--shim-grammar", action="append", default=[],
                    help="grammar file or built-in name (repeat for several)")
    group.addoption("--shim-eos", default=None, help="EOS token (text or id) if the files name none")
    group.addoption("--shim-profile", default="fast", help="conformance profile: fast or full")
    group.addoption("--shim-fail-on", default=None,
                    help="comma list of failure classes that fail (default: all but stale "
                         "known bugs)")
    group.addoption("--shim-logits-width", type=int, default=None)
    group.addoption("--shim-report", default=None, help="directory for the JSON + md reports")
    group.addoption("--shim-accept-known", action="append", default=[], metavar="ID",
                    help="acknowledge this known bug (repeat): met, it is listed but does not "
                         "fail its class; any other known bug met fails")


def _classes(config) -> tuple[str, ...]:
    return parse_fail_on(config.getoption("--shim-fail-on"))


class ConformanceItem(pytest.Item):
    """One grammar x failure class of the configured backend and tokenizer."""

    def __init__(self, *, grammar: str, failure_class: str, **kwargs):
        super().__init__(**kwargs)
        self.grammar = grammar
        self.failure_class = failure_class

    def _report(self):
        cache = self.config.stash.setdefault(_REPORTS, {})
        if self.grammar not in cache:
            opt = self.config.getoption
            report = run_conformance(opt("--shim-conformance"), opt("--shim-tokenizer"),
                                     self.grammar, opt("--shim-profile"),
                                     logits_width=opt("--shim-logits-width"),
                                     eos=opt("--shim-eos"), fail_on=_classes(self.config),
                                     accept_known=opt("--shim-accept-known"), gamma=False)
            if opt("--shim-report"):
                report.write(opt("--shim-report"), f"conformance-{Path(self.grammar).name}")
            cache[self.grammar] = report
        return cache[self.grammar]

    def runtest(self) -> None:
        report = self._report()
        failing = report.failing_classes()
        cells = failing.get(self.failure_class)
        if cells:
            raise ConformanceFailure(report, self.failure_class)
        # A class no check judged (the grammar did not compile, the check crashed or does
        # not apply) is skipped with the reason, never passed; the errors class fails.
        status = [cell.class_status(report.accept_known).get(self.failure_class)
                  for cell in report.cells]
        if status and all(s == "not run" for s in status):
            why = "; ".join(cell.error for cell in report.cells if cell.error) or \
                "no check of this class applies"
            pytest.skip(f"{self.failure_class} not run: {why}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return excinfo.value.explain()
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return Path(self.grammar), None, f"conformance {self.name}"


class ConformanceFailure(Exception):
    def __init__(self, report, failure_class: str):
        super().__init__(failure_class)
        self.report = report
        self.failure_class = failure_class

    def explain(self) -> str:
        checks = FAILURE_CLASSES[self.failure_class][1]
        lines = [f"{self.failure_class} failed (exit bit {FAILURE_CLASSES[self.failure_class][0]})"]
        for cell in self.report.cells:
            if self.failure_class == "errors":
                if cell.error:
                    lines.append(f"{cell.label}: {cell.error}")
                lines += [f"{cell.label}: check {c} checked nothing" for c in cell.vacuous_checks]
            if self.failure_class == "stale-known-bugs":
                lines += [f"{cell.label}: known bug {b} did not reproduce"
                          for b in cell.stale_known_bugs]
            for name in checks:
                check = cell.checks.get(name)
                if check is None:
                    continue
                unaccepted = check.unaccepted_known(self.report.accept_known)
                lines += [f"{cell.label} / {name}: known bug {b} met ({check.known[b]} "
                          "failures); accept it with --shim-accept-known / --accept-known "
                          f"{b}" for b in unaccepted]
                if not check.failed:
                    continue
                lines.append(f"{cell.label} / {name}: {check.failed} failed of "
                             f"{check.passed + check.failed}")
                lines += [f"  - {r.one_line()}" for r in check.failures if not r.known_bug][:20]
        return "\n".join(lines)


_REPORTS = pytest.StashKey[dict]()


def pytest_collection_modifyitems(session, config, items) -> None:
    backend = config.getoption("--shim-conformance")
    if not backend:
        return
    grammars = config.getoption("--shim-grammar")
    if not grammars:
        raise pytest.UsageError("--shim-conformance needs at least one --shim-grammar")
    if backend not in installed():
        raise pytest.UsageError(f"--shim-conformance: no backend named {backend!r} is "
                                f"installed; installed: {', '.join(installed()) or 'none'}")
    try:
        check_known_ids(config.getoption("--shim-accept-known"))
    except UnknownKnownBugError as exc:
        raise pytest.UsageError(f"--shim-accept-known: {exc}") from None
    tokenizer = Path(str(config.getoption("--shim-tokenizer"))).name
    for grammar in grammars:
        for failure_class in _classes(config):
            items.append(ConformanceItem.from_parent(
                session, name=f"{backend}/{tokenizer}/{Path(grammar).name}::{failure_class}",
                grammar=grammar, failure_class=failure_class))


@pytest.fixture
def shim_conformance():
    """``shim_conformance(backend, tokenizer, grammar, fail_on=None, **kw) -> Report``; fails
    the calling test on any selected failure class, listing the minimised repros."""
    def run(backend, tokenizer, grammar, fail_on=None, accept_known=(), **kwargs):
        kwargs.setdefault("gamma", False)
        report = run_conformance(backend, tokenizer, grammar, fail_on=fail_on,
                                 accept_known=accept_known, **kwargs)
        if report.exit_code:
            failing = [c for c in report.failing_classes() if c in report.fail_on]
            pytest.fail("\n\n".join(ConformanceFailure(report, c).explain() for c in failing),
                        pytrace=False)
        return report

    return run
