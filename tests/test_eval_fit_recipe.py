"""``shim eval`` fits with exactly ``shim fit``'s recipe: the same options, the same defaults,
the same code path (line-answer probe, top-ups), so the two give the same controller.

Shipped LM, SynCode, a tiny grammar the LM rarely finishes on its own: the probe folds the
newline into EOS on both paths, and a wide evidence band forces top-ups on both."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from shim_adapters import cli
from shim_adapters.backends.registry import backends
from shim_adapters.shim.fitting import CLI_EVIDENCE_BAND, FitRecipe, _Fit, _is_thin


def run(*args):
    return CliRunner().invoke(cli.main, list(map(str, args)))


def _without_timings(obj):
    if isinstance(obj, dict):
        return {k: _without_timings(v) for k, v in obj.items() if "seconds" not in k}
    if isinstance(obj, list):
        return [_without_timings(v) for v in obj]
    return obj


def _recipe_params(command) -> set[str]:
    return {p.name for p in command.params}


def test_fit_and_eval_declare_the_same_recipe_options():
    recipe = {"recipe_n_samples", "target", "rounds", "max_samples", "evidence_band",
              "text_features", "stop_at_newline", "chat", "batch_size"}
    assert recipe <= _recipe_params(cli.fit_command)
    assert recipe <= _recipe_params(cli.eval_command)
    # unset options take the library's defaults, the evidence band the commands' own
    built = cli._build_recipe(kind="LR_FULL", recipe_n_samples=None, target=None, rounds=None,
                              max_samples=None, evidence_band=None, stop_at_newline="auto",
                              chat=False, batch_size=64, max_new_tokens=None, seed=0)
    assert built == FitRecipe(evidence_band=CLI_EVIDENCE_BAND)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    (d / "g.lark").write_text('start: "a" "b"+\n')
    (d / "p.txt").write_text("Say ab:\n")
    # SynCode in the default environment, XGrammar where it is not installed (transformers 5)
    backend = "syncode" if "syncode" in backends() else "xgrammar"
    common = ["--grammar", d / "g.lark", "--prompt", d / "p.txt", "--backend", backend,
              "--max-new-tokens", "8", "--max-samples", "48", "--evidence-band", "100"]
    fit = run("fit", *common, "--n-samples", "24", "--seed", "1", "--out", d / "fit")
    assert fit.exit_code == 0, fit.stderr
    ev = run("eval", *common, "--n-train", "24", "--seed", "0", "--methods", "masking,lr_full",
             "--n-samples", "6", "--timing-samples", "0", "--asap-samples", "0",
             "--n-bootstrap", "5", "--out", d / "eval")
    assert ev.exit_code == 0, ev.stderr
    return (json.loads((d / "fit" / "manifest.json").read_text()),
            json.loads((d / "eval" / "controllers" / "g" / "lr_full" / "manifest.json")
                       .read_text()),
            json.loads((d / "eval" / "report.json").read_text()))


def test_eval_and_fit_give_the_same_controller(both):
    fitted, evaluated, _ = both
    assert evaluated["weights_sha256"] == fitted["weights_sha256"]
    assert _without_timings(evaluated["training"]) == _without_timings(fitted["training"])
    assert evaluated["lm_identifier"] == fitted["lm_identifier"]


def test_both_paths_ran_the_probe_and_the_top_ups(both):
    fitted, _, report = both
    training = fitted["training"]
    assert training["prompting"]["stop_at_newline"] is True
    assert "line_answer_probe" in training["prompting"]
    assert [r["kind"] for r in training["rounds"]] == ["first draw", "top-up"]
    assert "near the floor" in training["rounds"][1]["reason"]
    assert training["lm_samples_total"] == 48
    # every method of the evaluation saw the LM view the controller was fitted on
    assert report["cases"][0]["stop_at_newline"] is True
    assert report["cases"][0]["methods"]["lr_full"]["lm_samples_total"] == 48


@pytest.mark.parametrize("ess, reason, band, thin", [
    (5.0, "low_target_samples", 1.0, True),   # below the floor: thin at any band
    (0.0, "no_target_samples", 2.0, False),   # no target sample at all: not a band case
    (12.0, None, 1.0, False),                 # decided at the floor
    (12.0, None, 2.0, True),                  # inside the band: draw more first
    (12.0, "no_gain", 2.0, True),
    (25.0, None, 2.0, False),                 # above the band: decided
])
def test_the_evidence_band_covers_only_the_band_above_the_floor(ess, reason, band, thin):
    controller = SimpleNamespace(fallback_reason_=reason, heldout_effective_samples_=ess,
                                 min_target_samples=10.0)
    fit = _Fit("rollout", controller, None, [], [], 0, None)
    assert _is_thin(fit, FitRecipe(evidence_band=band)) is thin
    assert _is_thin(_Fit("final", controller, None, [], [], 0, None),
                    FitRecipe(evidence_band=band)) is False
