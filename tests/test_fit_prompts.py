"""One controller per grammar across prompts: a fit over a prompt set spreads its budget over
the prompts, pools the rows, judges trust on held-out prompts and records the set; a loaded
controller warns when it meets a prompt outside it. Shipped LM, XGrammar, the json grammar."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from shim_adapters import cli
from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.shim.artefact import PromptOutsideFitWarning, load_controller
from shim_adapters.shim.fitting import (
    FitRecipe,
    InProcessRollouts,
    PromptSetRollouts,
    fit_with_recipe,
    prepare_prompt,
)
from shim_adapters.shim.prompt_set import PromptSet, fitted_on, prompt_sha256, read_prompt_set

torch.set_num_threads(1)
FAST = {"n_splits": 3, "reg_grid": (1.0,)}
PROMPTS = ("A JSON object:\n", "Here is some JSON:\n", "JSON value:\n")


def test_prompt_files_one_per_line_or_json_lines(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompt_set(lines).prompts == ("first prompt", "second prompt")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Q: 1+1?\nA:"}) + "\n" +
                     json.dumps({"prompt": "x", "id": 3}) + "\n")
    got = read_prompt_set(jsonl)
    assert got.prompts == ("Q: 1+1?\nA:", "x")  # a JSON Lines prompt may span lines
    assert got.record()["size"] == 2 and got.record()["prompt_sha256"][1] == prompt_sha256("x")
    assert got.sha256 != PromptSet(("x", "Q: 1+1?\nA:")).sha256  # the order counts
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="line 2: no \"prompt\" string field"):
        read_prompt_set(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompt_set(empty)


def test_fitted_on_reads_the_set_or_the_one_prompt():
    one = {"prompt": "p", "training": {}}
    assert fitted_on(one, "p") is True and fitted_on(one, "q") is False
    assert fitted_on({"training": {}}, "p") is None
    many = {"prompt": "a", "training": {"prompt_set": PromptSet(("a", "b")).record()}}
    assert fitted_on(many, "b") is True and fitted_on(many, "c") is False


@pytest.fixture(scope="module")
def json_masker(shipped_lm):
    return get_backend("xgrammar").compile(builtin_grammar("json"), shipped_lm.tokenizer,
                                           shipped_lm.vocab_size)


@pytest.fixture(scope="module")
def set_fit(shipped_lm, json_masker, tmp_path_factory):
    out = tmp_path_factory.mktemp("set")
    recipe = FitRecipe(n_samples=31, max_samples=None, max_new_tokens=24,
                       stop_at_newline=False, progress=False, controller_params=FAST)
    c, manifest = fit_with_recipe(shipped_lm, json_masker, recipe, PromptSet(PROMPTS, "t"),
                                  output_dir=out)
    return c, manifest, out


def test_a_prompt_set_fit_spreads_the_budget_and_judges_on_held_out_prompts(set_fit):
    c, manifest, _ = set_fit
    t = manifest["training"]
    assert t["prompt_set"]["size"] == 3
    assert t["prompt_set"]["sha256"] == PromptSet(PROMPTS).sha256
    assert t["lm_samples_total"] == 31 == t["data_n_samples"]
    assert t["heldout_holds_out"] == "prompts" and c.cv_groups_ == "groups"
    assert t["prompting"]["probed_on"] == "the set's first prompt"
    assert manifest["prompt"] == PROMPTS[0]


def test_prompt_set_rollouts_label_each_completion_with_its_prompt(shipped_lm, json_masker):
    recipe = FitRecipe(n_samples=8, max_new_tokens=16, stop_at_newline=False, progress=False)
    sources = [InProcessRollouts(p.lm, json_masker, p.prefilled, max_new_tokens=16,
                                 progress=False)
               for p in (prepare_prompt(shipped_lm, json_masker, q, recipe) for q in PROMPTS)]
    data = PromptSetRollouts(sources).draw(8, "masked", seed=0)
    assert data.manifest["completion_prompt"] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert data.n_completions == 8
    # each completion keeps its own prompt's LM log-probabilities: the same completion text
    # under two prompts would score differently, so rows are not interchangeable between them
    assert np.isfinite(data.row_lm_logprob).all()


def test_load_controller_warns_outside_the_fitted_prompts(set_fit, shipped_lm, json_masker):
    _, _, out = set_fit
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromptOutsideFitWarning)
        load_controller(out, json_masker, shipped_lm, prompt=PROMPTS[1])  # inside: silent
        load_controller(out, json_masker, shipped_lm)  # no prompt given: nothing to check
    with pytest.warns(PromptOutsideFitWarning, match="not among its 3 fitted prompts"):
        load_controller(out, json_masker, shipped_lm, prompt="Something else:\n")


# ---- the command line: shim fit --prompts, shim eval --controller / --fit-prompts ----------

def run(*args):
    return CliRunner().invoke(cli.main, list(map(str, args)))


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "fit.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    (d / "eval.txt").write_text(PROMPTS[2].strip() + "\n")
    small = ["--grammar", "json", "--backend", "xgrammar", "--max-new-tokens", "16",
             "--stop-at-newline", "no"]
    fit = run("fit", *small, "--prompts", d / "fit.jsonl", "--n-samples", "20",
              "--max-samples", "20", "--out", d / "art")
    assert fit.exit_code == 0, fit.stderr
    return d, small


def test_shim_fit_prompts_records_the_set(cli_files):
    d, _ = cli_files
    t = json.loads((d / "art" / "manifest.json").read_text())["training"]
    assert t["prompt_set"]["size"] == 2 and t["prompt_set"]["source"] == str(d / "fit.jsonl")
    assert t["heldout_holds_out"] == "prompts" and t["lm_samples_total"] == 20
    card = (d / "art" / "MODEL_CARD.md").read_text()
    assert f"a set of 2 from {d / 'fit.jsonl'}" in card
    both = run("fit", "--grammar", "json", "--prompts", d / "fit.jsonl", "--prompt-text", "x",
               "--out", d / "nope")
    assert both.exit_code == 2 and "not both" in both.stderr


def test_shim_eval_scores_a_given_controller_without_refitting(cli_files):
    d, small = cli_files
    out = d / "scored"
    with pytest.warns(PromptOutsideFitWarning):
        ev = run("eval", *small, "--eval-prompts", d / "eval.txt", "--controller", d / "art",
                 "--methods", "masking,lr_full,mlp", "--n-samples", "6", "--timing-samples",
                 "0", "--asap-samples", "0", "--n-bootstrap", "5", "--out", out)
    assert ev.exit_code == 0, ev.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["methods"] == ["masking", "lr_full"]  # the artefact's kind stands in
    case = report["cases"][0]
    assert case["name"] == "json-p00"
    lr = case["methods"]["lr_full"]
    assert lr["given_controller"] == str(d / "art") and lr["prompt_in_fit_set"] is False
    assert lr["heldout_holds_out"] == "prompts" and "fit_seconds" not in lr
    assert not (out / "controllers").exists()  # nothing was fitted


def test_shim_eval_fits_on_one_prompt_set_and_measures_on_another(cli_files):
    d, small = cli_files
    out = d / "heldout"
    ev = run("eval", *small, "--fit-prompts", d / "fit.jsonl", "--eval-prompts",
             d / "eval.txt", "--methods", "masking,lr_full", "--n-samples", "6", "--n-train",
             "20", "--max-train", "20", "--timing-samples", "0", "--asap-samples", "0",
             "--n-bootstrap", "5", "--out", out)
    assert ev.exit_code == 0, ev.stderr
    report = json.loads((out / "report.json").read_text())
    lr = report["cases"][0]["methods"]["lr_full"]
    assert lr["fitted_on_prompts"] == 2 and lr["prompt_in_fit_set"] is False
    assert lr["prompt_set"]["size"] == 2
    fitted = json.loads((out / "controllers" / "fit-prompts" / "lr_full" / "manifest.json")
                        .read_text())
    assert fitted["training"]["prompt_set"]["sha256"] == PromptSet(PROMPTS[:2]).sha256
    assert "fitted once on 2 prompts" in (out / "report.md").read_text()


def test_shim_eval_compares_the_set_fit_with_each_prompts_own_fit(cli_files):
    d, small = cli_files
    out = d / "own"
    ev = run("eval", *small, "--fit-prompts", d / "fit.jsonl", "--eval-prompts",
             d / "eval.txt", "--own-fits", "--methods", "masking,lr_full", "--n-samples", "6",
             "--n-train", "20", "--max-train", "20", "--mixture-samples", "6",
             "--timing-samples", "0", "--asap-samples", "0", "--n-bootstrap", "5",
             "--out", out)
    assert ev.exit_code == 0, ev.stderr
    case = json.loads((out / "report.json").read_text())["cases"][0]
    assert case["methods"]["lr_full"]["fitted_on_prompts"] == 2
    own = case["methods"]["lr_full_own"]
    assert "fit_seconds" in own and "fitted_on_prompts" not in own
    assert (out / "controllers" / case["name"] / "lr_full" / "manifest.json").is_file()
    imp = case["importance"]
    assert {"masking", "lr_full", "lr_full_own"} <= set(imp["kl"])
    paired = imp["paired"]["lr_full − lr_full_own"]
    # the paired difference is the difference of the two KLs on the same weighted draws
    assert paired["diff"] == pytest.approx(imp["kl"]["lr_full"] - imp["kl"]["lr_full_own"],
                                           abs=1e-9)
    assert paired["ci"][0] <= paired["ci"][1]
    assert "minus the case's own fit" in (out / "report.md").read_text()
    alone = run("eval", *small, "--eval-prompts", d / "eval.txt", "--own-fits")
    assert alone.exit_code == 2 and "--fit-prompts" in alone.stderr


def test_shim_sample_warns_for_a_prompt_outside_the_fit(cli_files):
    d, _ = cli_files
    with pytest.warns(PromptOutsideFitWarning, match="not among its 2 fitted prompts"):
        out = run("sample", "--grammar", "json", "--backend", "xgrammar", "--prompt-text",
                  "Unrelated:\n", "--controller", d / "art", "-n", "1", "--max-new-tokens",
                  "4", "--seed", "0")
    assert out.exit_code == 0, out.stderr


def test_sample_with_shim_warns_for_a_prompt_outside_the_fit(cli_files):
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.shim.correction import sample_with_shim

    d, _ = cli_files
    lm = load_lm(None)
    masker = get_backend("xgrammar").compile(builtin_grammar("json"), lm.tokenizer,
                                             lm.vocab_size)
    controller, manifest = load_controller(d / "art", masker, lm)
    assert manifest["training"]["prompting"]["prompt_ids_sha256"]  # one per fitted prompt
    assert len(manifest["training"]["prompting"]["prompt_ids_sha256"]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromptOutsideFitWarning)
        sample_with_shim(lm, masker, controller, PROMPTS[1], 1, max_new_tokens=4, seed=0)
    with pytest.warns(PromptOutsideFitWarning, match="sample_with_shim: the prompt is not"):
        sample_with_shim(lm, masker, controller, "Unrelated:\n", 1, max_new_tokens=4, seed=0)
