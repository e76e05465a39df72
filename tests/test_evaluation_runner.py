"""run_eval end to end on the shipped LM: a quick binary5 run by default, the whole fast
profile (four built-in grammars, every method) under ``pytest -m slow``."""

from __future__ import annotations

import json
import math

import pytest

from shim_adapters.evaluation import EvalReport, load_suite, run_eval
from shim_adapters.evaluation.suites import BUILTIN_SUITES


def test_quick_binary5_run_writes_a_complete_report(tmp_path):
    report = run_eval("binary5", None, "xgrammar", methods=["masking", "lr_nt", "asap",
                                                           "rejection"],
                      n_samples=300, seed=0, out_dir=tmp_path, progress=False, n_train=300,
                      asap_samples=30, asap_checkpoints=(0, 10, 30), timing_samples=3,
                      n_bootstrap=50, target="rollout")
    (case,) = report.cases
    for name in ("report.json", "report.md", "kl_per_case.png", "distortion_binary5.png",
                 "kl_vs_support.png", "asap_kl_vs_samples.png", "language_kl_per_case.png"):
        assert (tmp_path / name).is_file(), name
    assert case["support"]["size"] > 10
    masking = case["methods"]["masking"]["kl"]
    assert masking["ci_low"] <= masking["kl"] <= masking["ci_high"]
    assert case["methods"]["rejection"]["kl"]["kl"] == 0.0
    assert [p["samples"] for p in case["asap_curve"]] == [0, 10, 30]
    assert case["asap_curve"][0]["kl"] == pytest.approx(masking["kl"], rel=1e-6)
    # the exact KL over the 17 strings: masking distorts, the target is reachable
    assert case["exact"]["kl"]["masking"] > 0.1
    assert case["exact"]["total_mass"]["masking"] == pytest.approx(1.0, abs=1e-5)
    for method in ("masking", "lr_nt", "asap", "rejection"):
        t = case["timing"][method]
        assert t["seconds_per_sample"] > 0 and t["phases"]["lm_forward"]["calls"] > 0
    assert case["timing"]["lr_nt"]["phases"]["gamma"]["calls"] > 0
    assert case["methods"]["asap"]["trie_bytes_per_token"] > 0
    # the whole-language KL: masking's Monte-Carlo estimate brackets its exact value, and
    # each method's paired difference to masking is reported (0 for masking itself)
    lang = case["methods"]["masking"]["language_kl"]
    assert abs(lang["kl"] - case["exact"]["kl"]["masking"]) <= lang["ci_high"] - lang["ci_low"]
    assert lang["diff"] == 0.0 and lang["n_valid"] == int(case["support"]["valid_draws"])
    assert math.isfinite(case["methods"]["lr_nt"]["language_kl"]["diff"])
    assert "language_kl" in case["asap_curve"][-1]
    shim = case["methods"]["lr_nt"]
    assert shim["target"] == "rollout" and shim["decision"]
    assert (shim["beta"] == 0.0) == shim["falls_back_to_masking"]
    # the JSON reads back into the same report
    again = EvalReport.from_json(tmp_path / "report.json")
    assert again.cases[0]["support"] == case["support"]
    md = (tmp_path / "report.md").read_text()
    assert "binary5" in md and "Exact KL" in md and "over the whole language" in md


def test_rescoring_from_stored_scores_reproduces_the_metrics(tmp_path):
    from shim_adapters.evaluation.rescore import rescore_report

    run_eval("binary5", None, "xgrammar", methods=["masking", "asap"], n_samples=200, seed=1,
             out_dir=tmp_path, progress=False, asap_samples=10, asap_checkpoints=(0, 10),
             timing_samples=1, n_bootstrap=30)
    before = json.loads((tmp_path / "report.json").read_text())
    (tmp_path / "report.md").unlink()
    after = rescore_report(tmp_path, plots=False)
    assert (tmp_path / "report.md").is_file()
    for name in ("masking", "asap"):
        for metric in ("kl", "language_kl"):
            assert after.cases[0]["methods"][name][metric] == pytest.approx(
                before["cases"][0]["methods"][name][metric], nan_ok=True)
    assert after.cases[0]["timing"] == before["cases"][0]["timing"]
    (tmp_path / "scores" / "binary5.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no stored scores"):
        rescore_report(tmp_path, plots=False)


def test_suite_files_and_errors(tmp_path):
    (tmp_path / "g.lark").write_text('start: "a" | "b"\n')
    (tmp_path / "p.txt").write_text("Say a or b:\n")
    (tmp_path / "s.toml").write_text(
        'name = "mine"\n[[cases]]\nname = "ab"\ngrammar = "g.lark"\nprompt_file = "p.txt"\n'
        'max_new_tokens = 4\nexact = true\n[[cases]]\ngrammar = "sql"\n')
    suite = load_suite(tmp_path / "s.toml")
    assert suite.name == "mine" and [c.name for c in suite.cases] == ["ab", "sql"]
    assert suite.cases[0].prompt == "Say a or b:\n" and suite.cases[0].exact
    assert suite.cases[1].prompt == suite.cases[1].grammar.default_prompt
    (tmp_path / "bad.json").write_text(json.dumps({"cases": [{"grammar": "sql", "x": 1}]}))
    with pytest.raises(ValueError, match=r"cases\[0\].*unknown key"):
        load_suite(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="neither a built-in"):
        load_suite("no-such-suite")
    assert [c.name for c in load_suite("fast").cases] == ["binary5", "bv4", "json", "sql"]
    assert set(BUILTIN_SUITES) >= {"fast", "binary5", "bv4", "spider", "json"}
    with pytest.raises(ValueError, match="unknown method"):
        run_eval("binary5", methods=["masking", "magic"], progress=False)


def test_benchmark_suites_read_from_a_path(tmp_path):
    (tmp_path / "p1.ebnf").write_text('root ::= "x" | "y"\n')
    (tmp_path / "p1.txt").write_text("Pick:\n")
    suite = load_suite("bv4", data_dir=tmp_path)
    assert [c.name for c in suite.cases] == ["p1"] and suite.cases[0].grammar.format == "ebnf"
    (tmp_path / "p2.ebnf").write_text('root ::= "z"\n')
    with pytest.raises(FileNotFoundError, match="p2.txt"):
        load_suite("bv4", data_dir=tmp_path)


@pytest.mark.slow
def test_fast_profile(tmp_path):
    """The fast profile: every method on the four built-in grammars with the shipped LM."""
    report = run_eval("fast", None, "xgrammar", n_samples=1000, seed=0, out_dir=tmp_path,
                      progress=False, timing_samples=10)
    assert [c["name"] for c in report.cases] == ["binary5", "bv4", "json", "sql"]
    for case in report.cases:
        for method in ("masking", "lr_nt", "lr_full", "mlp", "asap"):
            kl = case["methods"][method]["kl"]["kl"]
            assert math.isfinite(kl) and kl >= 0, (case["name"], method)
        assert case["support"]["size"] >= (17 if case["name"] == "binary5" else 50), case["name"]


def test_rarely_valid_case_is_measured_by_importance_sampling(tmp_path):
    """The shipped LM answers this prompt with binary digits, so bv4 is never valid in its
    unconstrained draws: rejection has nothing to show and says so, the controller is fitted on
    rollout labels, and the KL is still measured on the methods' own weighted samples."""
    suite = tmp_path / "rare.json"
    suite.write_text(json.dumps({"name": "rare", "cases": [
        {"name": "bv4-binary-prompt", "grammar": "bv4", "max_new_tokens": 48,
         "prompt": "Generate a binary string of length 5:\n"}]}))
    report = run_eval(str(suite), None, "xgrammar", methods=["masking", "lr_full", "rejection"],
                      n_samples=60, n_train=60, target="auto", mixture_samples=24,
                      timing_samples=0, n_bootstrap=20, progress=False,
                      out_dir=tmp_path / "out")
    case = report.cases[0]
    assert case["support"]["valid_draws"] == 0
    rej = case["methods"]["rejection"]
    assert rej["kl"] is None and "not measurable" in rej["note"]
    assert case["methods"]["lr_full"]["target"] == "rollout"
    imp = case["importance"]
    assert imp["draws_per_proposal"] == {"lm": 60, "masking": 24, "lr_full": 24}
    assert imp["p_valid"] < 1e-3 and set(imp["kl"]) == {"masking", "lr_full"}
    text = (tmp_path / "out" / "report.md").read_text()
    assert "by importance sampling" in text
    assert ("not measurable (ESS" in text) == (imp["ess"] < 10)
    # resuming keeps the finished case and runs nothing again
    again = run_eval(str(suite), None, "xgrammar", methods=["masking", "lr_full", "rejection"],
                     n_samples=60, n_train=60, mixture_samples=24, timing_samples=0,
                     progress=False, out_dir=tmp_path / "out", resume=True)
    assert [c["name"] for c in again.cases] == ["bv4-binary-prompt"]
    assert again.cases[0]["importance"]["ess"] == imp["ess"]
