"""The ``shim`` command on a user's own files: checked before the LM loads, one-line user
errors with exit status 2, a model card beside the artefact, keywords passed through."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from shim_adapters import cli
from shim_adapters.backends.registry import backends
from shim_adapters.lm import loading as lm_module

#: The backend the CLI picks for a Lark grammar when none is named: SynCode where it is
#: installed (the default environment), else XGrammar (transformers 5, no SynCode).
DEFAULT_BACKEND = "syncode" if "syncode" in backends() else "xgrammar"


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "g.lark").write_text('start: "a" "b"+\n')
    (tmp_path / "p.txt").write_text("Say ab:\n")
    (tmp_path / "schema.txt").write_text('{"type": "array", "uniqueItems": true}')
    (tmp_path / "bad.lark").write_text('start: "a" b\n')
    return tmp_path


@pytest.fixture()
def no_lm(monkeypatch):
    """Loading the LM is a test failure: validation must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the LM was loaded before the user's input was checked")

    monkeypatch.setattr(lm_module, "load_lm", refuse)


def run(*args):
    return CliRunner().invoke(cli.main, list(map(str, args)))


@pytest.mark.parametrize("args, message", [
    (["--grammar", "{d}/nope.lark"], "--grammar {d}/nope.lark: no such file"),
    (["--grammar", "{d}/schema.txt"], "add --format"),
    (["--grammar", "{d}/bad.lark", "--prompt", "{d}/p.txt"], "line 1: Rule 'b' used but not"),
    (["--grammar", "{d}/schema.txt", "--format", "json_schema", "--backend", "syncode"],
     "--backend syncode does not take json_schema"),
    (["--grammar", "{d}/g.lark", "--backend", "nosuch"], "no backend named 'nosuch'"),
    (["--grammar", "{d}/g.lark", "--prompt", "{d}/missing.txt"], "--prompt {d}/missing.txt: no"),
    (["--grammar", "{d}/g.lark", "--prompt", "{d}/p.txt", "--lm", "{d}/nolm"],
     "--lm {d}/nolm: no such model"),
    (["--grammar", "{d}/g.lark", "--prompt", "{d}/p.txt", "--controller", "{d}"],
     "no manifest.json"),
    (["--grammar", "{d}/g.lark", "-n", "0"], "0 is not in the range x>=1"),
    (["--grammar", "{d}/schema.txt", "--format", "json_schema", "--backend", "xgrammar",
      "--strict", "--prompt-text", "x"], "strict mode: xgrammar cannot enforce uniqueItems"),
    (["--grammar", "{d}/g.lark"], "has no built-in prompt: pass --prompt FILE"),
])
def test_sample_user_errors_are_one_line_exit_2_before_the_lm_loads(files, no_lm, args,
                                                                      message):
    if "syncode" in args and "syncode" not in backends():
        pytest.skip("backend 'syncode' is not installed (pip install plugins/shim-syncode)")
    result = run("sample", *(a.format(d=files) for a in args))
    assert result.exit_code == 2, result.output
    assert message.format(d=files) in result.stderr
    if "range" not in message:  # click's own usage errors keep click's layout
        assert result.stderr.startswith("shim sample: error: ")
        assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_internal_error_is_one_line_and_debug_shows_the_traceback(files, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(lm_module, "load_lm", broken)
    args = ["sample", "--grammar", files / "g.lark", "--prompt", files / "p.txt"]
    plain = run(*args)
    assert plain.exit_code == 1
    assert plain.stderr.strip() == ("shim sample: internal error: RuntimeError: boom (rerun "
                                    "with --debug for the traceback)")
    debug = run("--debug", *args)
    assert debug.exit_code == 1 and "Traceback" in debug.stderr and "boom" in debug.stderr


def test_check_prints_the_capability_report_without_an_lm(files, no_lm):
    result = run("check", "--grammar", files / "schema.txt", "--format", "json_schema",
                 "--backend", "outlines", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"where": "/", "construct": "uniqueItems", "support": "post-check",
            "note": ""} in report["constructs"]
    assert "does not enforce uniqueItems" in result.stderr


def _fake_fit(calls):
    def fit_with_recipe(lm, masker, recipe, prompt=None, *, output_dir=None, **kw):
        calls.append({"prompt": prompt, "target": recipe.target, "rounds": recipe.rounds,
                      "chat": recipe.chat, "n_samples": recipe.n_samples,
                      "max_samples": recipe.max_samples})
        return None, {"grammar_name": masker.grammar.name, "backend": masker.backend_name,
                      "training": {"heldout_kl_gain": 0.5, "heldout_kl_gain_se": 0.1,
                                   "falls_back_to_masking": False, "decision": "helps"},
                      "controller": {"kind": recipe.kind, "beta": 1.0}}
    return fit_with_recipe


def test_fit_passes_target_rounds_and_chat_through(files, monkeypatch):
    from shim_adapters.shim import fitting

    calls = []
    monkeypatch.setattr(fitting, "fit_with_recipe", _fake_fit(calls))
    result = run("fit", "--grammar", files / "g.lark", "--prompt", files / "p.txt", "--out",
                 files / "art", "--target", "auto", "--rounds", "3", "--chat",
                 "--n-samples", "7")
    assert result.exit_code == 0, result.stderr
    assert calls == [{"prompt": "Say ab:\n", "target": "auto", "rounds": 3, "chat": True,
                      "n_samples": 7, "max_samples": 1000}]
    assert "held-out KL gain over masking: 0.5 ± 0.1 nats" in result.stdout
    assert (files / "art" / "MODEL_CARD.md").is_file()


def test_fit_passes_the_sample_cap_through(files, monkeypatch):
    from shim_adapters.shim import fitting

    calls = []
    monkeypatch.setattr(fitting, "fit_with_recipe", _fake_fit(calls))
    result = run("fit", "--grammar", files / "g.lark", "--prompt", files / "p.txt", "--out",
                 files / "art", "--n-samples", "7", "--max-samples", "300")
    assert result.exit_code == 0, result.stderr
    assert [c["max_samples"] for c in calls] == [300]


def test_fit_refuses_a_recipe_it_cannot_run_in_one_line(files, monkeypatch):
    from shim_adapters.shim import fitting

    monkeypatch.setattr(fitting, "fit_with_recipe", _fake_fit([]))
    result = run("fit", "--grammar", files / "g.lark", "--prompt", files / "p.txt", "--out",
                 files / "art", "--rounds", "3", "--target", "final")
    assert result.exit_code == 2
    assert "the 'final' target cannot use them" in result.stderr


def test_fit_then_sample_with_the_controller(files):
    art = files / "art"
    fit = run("fit", "--grammar", files / "g.lark", "--prompt", files / "p.txt", "--out", art,
              "--n-samples", "40", "--max-new-tokens", "8", "--target", "rollout")
    assert fit.exit_code == 0, fit.stderr
    assert fit.stdout.splitlines()[0].startswith(
        f"fitted LR_FULL for grammar g.lark on {DEFAULT_BACKEND}")
    assert "decision: " in fit.stdout and len(fit.stdout.splitlines()) <= 6
    card = (art / "MODEL_CARD.md").read_text()
    assert "## Fitted on" in card and "Say ab:" in card and "held-out KL gain" in card
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["training"]["decision"] in card
    sample = run("sample", "--grammar", files / "g.lark", "--prompt", files / "p.txt",
                 "--controller", art, "-n", "3", "--max-new-tokens", "8", "--seed", "0")
    assert sample.exit_code == 0, sample.stderr
    rows = [json.loads(line) for line in sample.stdout.splitlines()]
    assert len(rows) == 3 and all(set(r) >= {"text", "complete", "valid"} for r in rows)
    assert all(r["valid"] == (r["complete"] and r["text"].startswith("a")) for r in rows)
    wrong = run("sample", "--grammar", "binary5", "--controller", art)
    assert wrong.exit_code == 2 and "fitted for grammar 'g.lark'" in wrong.stderr


def test_sample_marks_incomplete_outputs(files):
    result = run("sample", "--grammar", files / "g.lark", "--prompt-text", "Say ab:\n", "-n",
                 "2", "--max-new-tokens", "1", "--seed", "0")
    assert result.exit_code == 0, result.stderr
    for row in map(json.loads, result.stdout.splitlines()):
        assert row["complete"] is False and row["valid"] is False
        assert "incomplete: hit --max-new-tokens 1" in row["problems"][0]


def test_eval_one_case_from_files(files):
    out = files / "eval"
    result = run("eval", "--grammar", files / "g.lark", "--prompt", files / "p.txt",
                 "--methods", "masking", "--n-samples", "30", "--timing-samples", "2",
                 "--n-bootstrap", "10", "--max-new-tokens", "8", "--backend", DEFAULT_BACKEND,
                 "--out", out)
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in report["cases"]] == ["g"]
    bad = run("eval", "--suite", "fast", "--grammar", files / "g.lark")
    assert bad.exit_code == 2 and "give --suite S" in bad.stderr
    # the shipped LM is not an instruct LM: --chat says so in one line
    no_chat = run("eval", "--grammar", files / "g.lark", "--prompt", files / "p.txt", "--chat",
                  "--methods", "masking", "--n-samples", "4", "--timing-samples", "0",
                  "--backend", DEFAULT_BACKEND, "--out", files / "eval-chat")
    assert no_chat.exit_code == 2 and "no chat template" in no_chat.stderr


def test_explain_says_why_a_token_is_refused(files):
    result = run("explain", "--grammar", files / "g.lark", "--after", "a", "--token", "a")
    assert result.exit_code == 0, result.stderr
    assert "'a': refused (no terminal the state expects" in result.stdout
    bad = run("explain", "--grammar", files / "g.lark", "--after", "b", "--token", "a")
    assert bad.exit_code == 2 and "is not a prefix of the language" in bad.stderr


def test_sample_reads_xgrammar_features_the_way_the_controller_was_fitted(tmp_path):
    """An artefact fitted on XGrammar's absolute-offset state key (every artefact written
    before the position-free default) still loads through the CLI: the masker is rebuilt with
    the readout its manifest records instead of failing on the fingerprint."""
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.shim.fitting import fit_controller

    lm = load_lm(None)
    grammar = builtin_grammar("bv4")
    masker = get_backend("xgrammar").compile(grammar, lm.tokenizer, lm.vocab_size,
                                             start_positions="absolute")
    art = tmp_path / "art"
    fit_controller(lm, masker, grammar.default_prompt, n_samples=24, max_new_tokens=24,
                   output_dir=art, progress=False)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["xgrammar_features"].startswith("start_positions=absolute")
    sample = run("sample", "--grammar", "bv4", "--backend", "xgrammar", "--controller", art,
                 "-n", "2", "--max-new-tokens", "24", "--seed", "0")
    assert sample.exit_code == 0, sample.stderr
    assert len(sample.stdout.splitlines()) == 2


def test_backends_lists_one_row_per_feature_status_of_a_backend():
    result = CliRunner().invoke(cli.main, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.output) if r["backend"] == "outlines"]
    by_format = {fmt: r for r in rows for fmt in r["formats"]}
    assert len(rows) == 2 and set(by_format) >= {"lark", "regex", "json_schema"}
    # outlines_core's DFA has no parser state; llguidance's CFG path derives one.
    assert by_format["regex"]["parser_state"] == "missing"
    assert by_format["lark"]["parser_state"] == "derived"
