"""The matrix script's sample cap and ``--redo``: the fit's cap reaches every SHIM fit, and a
redo drops exactly the named problems' stored results (shipped LM, a two-problem suite)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from shim_adapters.evaluation import run_eval
from shim_adapters.evaluation.runner import EvalReport

torch.set_num_threads(1)
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_lm_matrix.py"


def _matrix():
    spec = importlib.util.spec_from_file_location("real_lm_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def two_problems(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    suite = root / "two.json"
    suite.write_text(json.dumps({"name": "two", "cases": [
        {"name": "a", "grammar": "binary5", "max_new_tokens": 16},
        {"name": "b", "grammar": "bv4", "max_new_tokens": 48}]}))
    out = root / "out"
    report = run_eval(str(suite), None, "xgrammar", methods=["masking", "lr_full"],
                      n_samples=40, n_train=40, max_train=60, target="auto", timing_samples=0,
                      n_bootstrap=20, progress=False, out_dir=out)
    return report, out


def test_the_cap_reaches_every_fit_and_is_reported(two_problems):
    report, _ = two_problems
    for case in report.cases:
        fit = case["methods"]["lr_full"]
        assert fit["max_train"] == 60
        assert 40 <= fit["lm_samples_total"] <= 60
        assert fit["training_samples"] == fit["lm_samples_total"]
        assert sum(r["lm_samples"] for r in fit["rounds"]) == fit["lm_samples_total"]


def _merge_script():
    path = SCRIPT.parent / "matrix_merge.py"
    spec = importlib.util.spec_from_file_location("matrix_merge", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_suite_split_over_two_folders_merges_back(two_problems, tmp_path):
    """Runs before the redo test below, which drops problem b from the shared folder."""
    import shutil

    _, out = two_problems
    first, second = tmp_path / "A" / "two", tmp_path / "B" / "two"
    shutil.copytree(out, first)
    shutil.copytree(out, second)
    _matrix().drop_cases(first, {"b"})
    _matrix().drop_cases(second, {"a"})
    assert _merge_script().main([str(tmp_path / "B"), str(tmp_path / "A")]) == 0
    merged = EvalReport.from_json(first / "report.json")
    assert sorted(c["name"] for c in merged.cases) == ["a", "b"]
    assert (first / "scores" / "b.safetensors").is_file()
    assert (first / "controllers" / "b").is_dir()
    original = {c["name"]: c for c in EvalReport.from_json(out / "report.json").cases}
    for case in merged.cases:  # every number travels unchanged
        before = original[case["name"]]
        assert json.dumps(case, sort_keys=True) == json.dumps(before, sort_keys=True)


def test_redo_drops_only_the_named_problems(two_problems):
    _, out = two_problems
    assert (out / "scores" / "b.safetensors").is_file() and (out / "controllers" / "b").is_dir()
    assert _matrix().drop_cases(out, {"b", "not-there"}) == ["b"]
    kept = EvalReport.from_json(out / "report.json")
    assert [c["name"] for c in kept.cases] == ["a"]
    assert not (out / "scores" / "b.safetensors").exists()
    assert not (out / "controllers" / "b").exists()
    assert (out / "scores" / "a.safetensors").is_file() and (out / "controllers" / "a").is_dir()
    assert _matrix().drop_cases(out, {"b"}) == []


def test_redo_of_an_unknown_problem_and_a_cap_below_the_first_draw_are_errors(tmp_path,
                                                                               capsys):
    (tmp_path / "BV4").mkdir()
    (tmp_path / "BV4" / "p1.ebnf").write_text('root ::= "x" | "y"\n')
    (tmp_path / "BV4" / "p1.txt").write_text("Pick:\n")
    main = _matrix().main
    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path), "--suites", "bv4", "--redo", "p9", "--out",
              str(tmp_path / "o")])
    assert "--redo: no problem named p9 in suites bv4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path), "--suites", "bv4", "--n-train", "2000", "--out",
              str(tmp_path / "o")])
    assert "--n-train 2000 exceeds --max-train 1000" in capsys.readouterr().err
