"""Conformance fails closed: each failure class sets its exit bit, crashes are failures, a
grammar rule that never finishes is diagnosed, and each new check catches its injected fault."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from shim_adapters.backends.registry import get_backend
from shim_adapters.conformance import run_conformance
from shim_adapters.conformance.__main__ import main as conformance_main
from shim_adapters.conformance.faults import faulty_backend
from shim_adapters.conformance.generate import valid_strings
from shim_adapters.conformance.grammar_analysis import grammar_diagnostics
from shim_adapters.conformance.known_bugs import expected_known_bugs, match_known_bug
from shim_adapters.conformance.prefix import prefix_checker
from shim_adapters.conformance.report import FAILURE_CLASSES, Repro, parse_fail_on
from shim_adapters.grammars.grammar import Grammar, load_grammar

ROOT = Path(__file__).resolve().parents[1]
UNFINISHED = ROOT / "conformance" / "grammars" / "unfinished_list.lark"
PERSON = ROOT / "conformance" / "grammars" / "person.json"
#: Small sampling phases: these tests are about the verdicts, not the coverage of sampling.
SMALL = dict(gamma=False, uniform_walks=1, rare_walks=1, valid_strings=4, exhaustive_states=8)


def _run(backend, grammar="binary5", tokenizer="default", **kw):
    return run_conformance(backend, tokenizer, grammar, "fast", **{**SMALL, **kw})


def test_healthy_backend_passes_every_class_including_the_exhaustive_check():
    report = _run("xgrammar")
    cell = report.cells[0]
    ex = cell.checks["soundness"].info["exhaustive"]
    assert report.exit_code == 0 and not report.failing_classes(), report.to_markdown()
    assert ex["states"] >= 2 and ex["tokens_checked"] > 1000
    assert ex["wrongly_allowed"] == ex["wrongly_blocked"] == ex["dead_end_tokens"] == 0


def _exhaustive(report):
    return report.cells[0].checks["soundness"].info["exhaustive"]


def test_unsound_token_after_the_start_is_found_exhaustively_and_identically_at_every_seed():
    spec = faulty_backend(get_backend("xgrammar"), "unsound_late")
    rows = []
    for seed in (0, 7):
        report = _run(spec, seed=seed)
        ex = _exhaustive(report)
        assert report.exit_code & FAILURE_CLASSES["soundness"][0]
        # Every state after the first token shows the injected token, and only it.
        late = [r for r in ex["per_state"] if r["prefix_tokens"] >= 1]
        assert late and all(r["wrongly_allowed"] == 1 and r["wrongly_blocked"] == 0
                            for r in late)
        assert all("shortest_unsound_token" in r for r in late)
        rows.append([(r["prefix"], r["wrongly_allowed"], r["shortest_unsound_token"][0])
                     for r in late])
    assert rows[0] == rows[1]  # the exhaustive states do not depend on the seed


def test_refused_rare_token_is_a_completeness_failure_with_its_own_exit_bit():
    spec = faulty_backend(get_backend("xgrammar"), "refuse_last_allowed")
    report = _run(spec)
    per_state = _exhaustive(report)["per_state"]
    assert per_state and all(row["wrongly_blocked"] == 1 for row in per_state
                             if row["viable"])
    assert all(row["wrongly_allowed"] == 0 for row in per_state)
    # Completeness (2); where the refused token was the only one, also a dead end (4).
    assert report.exit_code & FAILURE_CLASSES["completeness"][0]
    assert not report.exit_code & FAILURE_CLASSES["soundness"][0]
    assert report.exit_status("soundness") == 0  # --fail-on narrows what fails the run


def test_a_crashing_masker_is_an_error_never_a_pass_and_sets_no_other_bit():
    spec = faulty_backend(get_backend("xgrammar"), "crash_late")
    report = _run(spec)
    cell = report.cells[0]
    crashed = {name: c.error for name, c in cell.checks.items() if c.error}
    assert crashed and all("injected crash" in e for e in crashed.values()), crashed
    # the crash is the errors class only: the checks it stopped are not judged, not passed
    assert report.exit_code == FAILURE_CLASSES["errors"][0], report.to_markdown()
    status = cell.class_status()
    assert status["soundness"] in ("not run", "incomplete") and status["errors"] == "failed"
    assert "ERROR" in report.to_markdown()


@pytest.mark.parametrize("fault,check,kind,klass", [
    ("stuck_late", "no_dead_ends", "dead_end", "dead-ends"),
    ("no_raise", "tokenizer_edges", "forbidden_text_not_refused", "completeness"),
    ("short_mask", "soundness", "mask_shape", "soundness"),
])
def test_each_remaining_check_class_catches_its_injected_fault(fault, check, kind, klass):
    report = _run(faulty_backend(get_backend("xgrammar"), fault))
    cell = report.cells[0]
    assert cell.error is None, cell.error  # a finding with a repro, not a crash
    result = cell.checks[check]
    assert result.failed and any(r.kind == kind and not r.known_bug for r in result.failures), \
        [r.one_line() for r in result.failures]
    assert report.exit_code & FAILURE_CLASSES[klass][0]
    assert klass in report.failing_classes()


def test_a_backend_that_cannot_compile_the_asked_grammar_fails_the_run():
    report = _run("syncode", grammar=str(ROOT / "conformance" / "grammars" / "email.regex"))
    assert report.cells[0].error and report.exit_code & FAILURE_CLASSES["errors"][0]


def test_unfinishable_rule_is_diagnosed_and_entering_it_is_a_dead_end():
    grammar = load_grammar(UNFINISHED)
    assert any("rule items can never finish" in d for d in grammar_diagnostics(grammar))
    exact, syntactic = prefix_checker(grammar), prefix_checker(grammar, finite=False)
    assert exact.viable("[]") and exact.viable("[") and not exact.viable("[1")
    assert syntactic.viable("[1,2,")
    report = _run("xgrammar", grammar=str(UNFINISHED))
    dead = report.cells[0].checks["no_dead_ends"]
    assert report.exit_code == FAILURE_CLASSES["dead-ends"][0], report.to_markdown()
    assert any(r.kind == "no_finite_completion" and r.prefix_text == "[" for r in dead.failures)
    assert report.cells[0].checks["soundness"].failed == 0  # never invalid output, only no end


def test_generator_never_recurses_without_bound_on_non_terminating_rules():
    grammar = Grammar('start: "a" b | "c"\nb: "x" b\n', "lark", "loop")
    strings, rejected = valid_strings(grammar, 5, seed=0)
    assert [s for _, s in strings] == ["c"] and rejected == 0
    empty = Grammar('start: "a" start\n', "lark", "empty")
    assert valid_strings(empty, 3, seed=0)[0] == []
    assert "the grammar accepts no string" in grammar_diagnostics(empty)[0]
    assert not prefix_checker(empty).viable("")


def test_a_check_that_checks_nothing_is_an_error():
    report = _run("xgrammar", grammar=Grammar('start: "a" start\n', "lark", "empty"))
    cell = report.cells[0]
    assert "completeness" in cell.vacuous_checks
    assert report.exit_code & FAILURE_CLASSES["errors"][0]


def test_fail_on_parsing():
    assert parse_fail_on("soundness, errors") == ("soundness", "errors")
    assert set(parse_fail_on("all")) == set(FAILURE_CLASSES)
    assert "stale-known-bugs" not in parse_fail_on(None)
    with pytest.raises(ValueError, match="unknown failure class 'speed'"):
        parse_fail_on("soundness,speed")


def test_cli_exit_status_fail_on_and_junit_xml(tmp_path, capsys):
    xml_path = tmp_path / "conformance.xml"
    args = ["--backend", "xgrammar", "--grammar", str(UNFINISHED), "--junit-xml", str(xml_path)]
    assert conformance_main(args) == 4
    suite = ET.parse(xml_path).getroot().find("testsuite")
    assert int(suite.get("failures")) >= 1
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failed == ["no_dead_ends"]
    assert conformance_main(args + ["--fail-on", "soundness,completeness"]) == 0
    capsys.readouterr()
    # usage errors exit 2 (as argparse does), before anything loads
    for bad in (["--backend", "xgrammar", "--grammar", "binary5", "--tokenizer",
                 str(tmp_path / "missing")],
                ["--backend", "nope", "--grammar", "binary5"],
                ["--backend", "xgrammar", "--grammar", str(tmp_path / "missing.lark")],
                ["--backend", "xgrammar", "--grammar", "binary5", "--accept-known", "typo"]):
        assert conformance_main(bad) == 2, bad
        assert "usage error" in capsys.readouterr().err
    # a file that exists but does not load is the errors class
    broken = tmp_path / "broken.lark"
    broken.write_text("start: (((\n")
    assert conformance_main(["--backend", "xgrammar", "--grammar", str(broken)]) & 8


def test_known_bugs_match_the_construct_and_version_only():
    schema = load_grammar(PERSON)

    def eos(text):
        return Repro("soundness", "eos_not_accepting", "outlines", "gpt2", "person.json", text,
                     [], None, None, "EOS allowed")

    bounds = eos('{"name": "a", "age": -787, "role": "guest"}')
    missing = eos('{"name": "a", "role": "guest"}')  # breaks `required`, not the bounds
    assert match_known_bug(bounds, "outlines_core 0.2.14", schema) == \
        "outlines-core-schema-integer-bounds"
    assert match_known_bug(missing, "outlines_core 0.2.14", schema) is None
    assert match_known_bug(bounds, "outlines_core 0.3.0", schema) is None

    def token(prefix, text):
        return Repro("soundness", "unsound_token", "outlines", "shipped", "person.json",
                     prefix, [], 1, text, "allowed", added_text=text)

    # The relaxed reading now ends a plain integer at its bound: the same bug, token by token.
    assert match_known_bug(token('{"name":"a","age":837', ","), "outlines_core 0.2.14",
                           schema) == "outlines-core-schema-integer-bounds"
    assert match_known_bug(token('{"name":"abcdefghijkl', "m"), "outlines_core 0.2.14",
                           schema) is None  # maxLength: another construct
    assert "xgrammar-schema-escapes-refused" in expected_known_bugs("xgrammar", "0.2.9", schema)
    # worked around by the plugin: not expected, and a recurrence is a failure again
    assert "xgrammar-schema-raw-control-chars" not in expected_known_bugs("xgrammar", "0.2.9",
                                                                         schema)
    assert expected_known_bugs("xgrammar", "0.3.0", schema) == []


@pytest.mark.parametrize("prefix,token,known", [
    ('{"name":"a\\', "u", True),       # the escape's backslash came in an earlier token
    ('{"name":"a', "\\u00", True),     # the whole escape start in one token
    ('{"name":', '"\\u', True),        # a token that opens the string and starts the escape
    ('{"name":', '"\\n', False),       # a short escape: not this bug
    ('{"name":"a\\\\', "u", False),   # an escaped backslash, then a plain 'u'
])
def test_the_unicode_escape_bug_matches_wherever_the_escape_starts(prefix, token, known):
    schema = load_grammar(PERSON)
    repro = Repro("completeness", "valid_token_refused", "outlines", "shipped", "person.json",
                  prefix, [], 1, token, "refused", added_text=token)
    expected = "outlines-core-schema-unicode-escape-refused" if known else None
    assert match_known_bug(repro, "outlines_core 0.2.14", schema) == expected


def test_a_known_bug_that_no_longer_reproduces_is_reported_stale():
    # binary5 has no JSON string: pretend the raw-control-chars bug applied here by asking
    # for the schema cell on a backend version where the entry applies but the cell is clean.
    report = _run("xgrammar", grammar=str(PERSON), tokenizer="default")
    cell = report.cells[0]
    seen = {r.known_bug for c in cell.checks.values() for r in c.failures if r.known_bug}
    expected = set(expected_known_bugs("xgrammar", cell.backend_version, load_grammar(PERSON)))
    assert set(cell.stale_known_bugs) == expected - seen - set(cell.replayed_known_bugs)
    data = json.loads(report.to_json())
    assert data["exit_status"] == report.exit_code
    if cell.stale_known_bugs:
        assert report.exit_status("all") & FAILURE_CLASSES["stale-known-bugs"][0]


def test_dfa_final_state_bug_matches_only_after_a_complete_match():
    from shim_adapters.conformance.runner import _resolve_grammar

    semver = _resolve_grammar(str(ROOT / "conformance" / "grammars" / "semver.regex"))
    assert not semver.text.endswith("\n")  # a .regex file means its content without the newline

    def refused(prefix):
        return Repro("completeness", "valid_token_refused", "outlines", "shipped",
                     "semver.regex", prefix, [], 5, "-", "refused")

    assert match_known_bug(refused("7.3"), "outlines_core 0.2.14", semver) == \
        "outlines-core-regex-leaves-final-state"
    assert match_known_bug(refused("7."), "outlines_core 0.2.14", semver) is None
    spanning = refused("7")  # the token ".3-" passes the complete match "7.3"
    spanning.token_text = ".3-"
    assert match_known_bug(spanning, "outlines_core 0.2.14", semver) == \
        "outlines-core-regex-leaves-final-state"
    assert match_known_bug(refused("7.3"), "outlines_core 0.2.15", semver) is None


def test_contract_runs_on_every_format_a_backend_declares():
    from shim_adapters.conformance.contract import FORMAT_GRAMMARS, contract_grammars

    for backend in ("xgrammar", "outlines", "syncode"):
        formats = set(get_backend(backend).grammar_formats)
        names = contract_grammars(backend)
        assert {FORMAT_GRAMMARS[n].format for n in names if n in FORMAT_GRAMMARS} == \
            formats - {"lark"}


def test_feature_status_is_registered_per_format_and_checked_per_masker():
    """shim-outlines compiles regex/JSON schema with outlines_core and CFGs with llguidance:
    its registration says so per format, so every masker matches its own registration, and
    a masker that declares another status than its format's registration still fails."""
    from shim_adapters.backends.spec import BackendSpec
    from shim_adapters.conformance.contract import (
        KNOWN_CONTRACT_VIOLATIONS,
        ContractViolation,
        check_features_match_status,
        contract_masker,
    )
    from shim_adapters.mask.protocol import FeatureStatus

    spec = get_backend("outlines")
    assert not KNOWN_CONTRACT_VIOLATIONS
    for grammar in ("regex:semver", "json_schema:point", "json"):
        masker = contract_masker("outlines", grammar)
        assert dict(masker.feature_status) == dict(spec.feature_status_for(masker.grammar.format))
        check_features_match_status(masker, spec)
    assert spec.feature_status_for("regex")["parser_state"] is FeatureStatus.MISSING
    assert spec.feature_status_for("lark")["parser_state"] is FeatureStatus.DERIVED
    wrong = BackendSpec(**{**spec.__dict__, "feature_status_by_format": {}})
    with pytest.raises(ContractViolation, match="registered for regex"):
        check_features_match_status(contract_masker("outlines", "regex:semver"), wrong)
    with pytest.raises(ValueError, match="formats it does not take"):
        BackendSpec(**{**spec.__dict__, "feature_status_by_format": {
            "sql": dict(spec.feature_status)}})


def test_known_bug_probes_reproduce_the_bug_and_stay_quiet_on_a_correct_backend():
    """A probe replays its bug deterministically where sampling may miss it, and finds nothing
    on a backend without the bug (XGrammar allows newlines between JSON tokens; outlines_core,
    and shim-xgrammar since its JSON string guard, refuse raw control characters in
    strings), so it cannot hide a fixed bug."""
    from shim_adapters.conformance.checks import replay_known_bug
    from shim_adapters.conformance.profiles import get_profile
    from shim_adapters.conformance.runner import (
        _resolve_backend,
        _resolve_grammar,
        compile_cell,
        resolve_tokenizer,
    )

    tok = resolve_tokenizer("default")
    grammar = _resolve_grammar(str(PERSON))
    contexts = {name: compile_cell(_resolve_backend(name), tok, grammar, get_profile("fast"))[1]
                for name in ("xgrammar", "outlines")}
    # XGrammar 0.2.9 allows raw control characters in schema strings; the plugin's JSON
    # string guard refuses them, so the probe looks and finds the plugin right
    shows, where = replay_known_bug(contexts["xgrammar"], "xgrammar-schema-raw-control-chars")
    assert shows is False, where
    shows, where = replay_known_bug(contexts["outlines"], "outlines-core-schema-whitespace")
    assert shows is True and "refused after" in where
    assert replay_known_bug(contexts["outlines"], "xgrammar-schema-raw-control-chars")[0] is False
    assert replay_known_bug(contexts["xgrammar"], "outlines-core-schema-whitespace")[0] is False


def test_a_grammar_that_does_not_compile_reports_its_classes_as_not_run():
    report = _run("syncode", grammar=str(ROOT / "conformance" / "grammars" / "email.regex"))
    status = report.cells[0].class_status()
    assert status["errors"] == "failed"
    assert all(status[c] == "not run" for c in ("soundness", "completeness", "dead-ends",
                                                 "control-tokens")), status
    assert report.exit_code == FAILURE_CLASSES["errors"][0]
    assert "not run" in report.to_markdown()


def test_a_crash_in_the_gamma_check_is_an_error_not_a_soundness_failure():
    """A dead end makes the γ check's sampling crash: the dead end is its own class and the
    crash an error; the soundness bit stays clear."""
    report = _run(faulty_backend(get_backend("xgrammar"), "stuck_late"), gamma=True,
                  gamma_samples=2, gamma_max_new_tokens=4)
    cell = report.cells[0]
    gamma = cell.checks["gamma"]
    assert gamma.failed == 0 and (gamma.error or gamma.not_run), gamma
    assert not report.exit_code & FAILURE_CLASSES["soundness"][0], report.to_markdown()
    assert report.exit_code & FAILURE_CLASSES["dead-ends"][0]


def _schema_repro(prefix, token_bytes, kind="valid_token_refused"):
    text = token_bytes.decode(errors="replace")
    return Repro("completeness", kind, "xgrammar", "gpt2", "s.json", prefix, [], 1, text,
                 "refused", token_hex=token_bytes.hex())


@pytest.mark.parametrize("schema,prefix,token,known", [
    # the escape is refused inside a maxLength string: XGrammar's bug
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}},
     '{"a":"x', b"\\", True),
    # no maxLength anywhere: the bug cannot apply, whatever the token
    ({"type": "object", "properties": {"a": {"type": "string"}}}, '{"a":"x', b"\\", False),
    # maxLength on another member: this string is not bounded
    ({"type": "object", "properties": {"a": {"type": "string"},
                                       "b": {"type": "string", "maxLength": 4}}},
     '{"b":"x","a":"x', b"\\", False),
    # a maxLength array item
    ({"type": "object", "properties": {"t": {"type": "array", "items": {
        "type": "string", "maxLength": 3}}}}, '{"t":["x', b"\\n", True),
    # a partial-UTF-8 byte token: its display b'\xed' has a backslash, its bytes do not
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}},
     '{"a":"x', b"\xed", False),
])
def test_the_maxlength_escape_bug_matches_only_its_construct_and_bytes(schema, prefix, token,
                                                                      known):
    grammar = Grammar(json.dumps(schema), "json_schema", "s.json")
    got = match_known_bug(_schema_repro(prefix, token), "0.2.9", grammar)
    assert (got == "xgrammar-schema-escapes-refused") is known, got
    assert match_known_bug(_schema_repro(prefix, token), "0.2.9", None) is None


def test_accept_known_names_only_real_bugs():
    from shim_adapters.conformance.known_bugs import UnknownKnownBugError, check_known_ids

    assert check_known_ids("xgrammar-schema-escapes-refused") == \
        ("xgrammar-schema-escapes-refused",)
    with pytest.raises(UnknownKnownBugError, match="no known bug 'typo'"):
        check_known_ids(["typo"])
