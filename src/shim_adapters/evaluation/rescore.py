"""Recompute a report's metrics from its stored scores, without sampling anything again.

``run_eval`` writes, per case, the exact log-probabilities of every distinct valid draw under
the LM and under each method (``scores/<case>.safetensors``). Sampling is the expensive part of
an evaluation (hours for SmolLM2 on a CPU); metrics are cheap. This rewrites ``report.json``,
``report.md`` and the plots with the current metric code, keeping timings and fit details.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shim_adapters.evaluation.metrics import bootstrap_kl, language_kl, stability_curve
from shim_adapters.evaluation.report import write_report
from shim_adapters.evaluation.runner import EvalReport
from shim_adapters.evaluation.scoring import MASKING


def rescore_report(out_dir: str | Path, *, plots: bool = True) -> EvalReport:
    """Recompute the support KL, the language KL and the |S| curves of every case in
    ``out_dir`` from ``scores/``; returns the updated report (also written back)."""
    from safetensors.numpy import load_file


    out = Path(out_dir)
    report = EvalReport.from_json(out / "report.json")
    n_boot = int(report.options.get("n_bootstrap", 200))
    seed = int(report.options.get("seed", 0))
    for case in report.cases:
        path = out / "scores" / f"{case['name']}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"{path}: case {case['name']!r} of {out / 'report.json'} has "
                                    f"no stored scores; it cannot be rescored")
        tensors = load_file(str(path))
        ids, target = tensors["draw_ids"], tensors["lm"]
        methods = {k[len("method."):].replace("_at_", "@"): v for k, v in tensors.items()
                   if k.startswith("method.")}
        if MASKING not in methods:
            raise ValueError(f"{path}: no masking scores (the reference of every difference)")
        curve = {p["samples"]: p for p in case.get("asap_curve", [])}
        for name, lp in methods.items():
            est = bootstrap_kl(ids, target, lp, n_bootstrap=n_boot, seed=seed)
            lang = language_kl(ids, target, lp, methods[MASKING], n_bootstrap=n_boot, seed=seed)
            if name.startswith("asap@"):
                samples = int(name.split("@")[1])
                curve.setdefault(samples, {"samples": samples}).update(
                    **est.as_dict(), language_kl=lang.as_dict())
                if samples == report.options.get("asap_samples") and "asap" in case["methods"]:
                    case["methods"]["asap"].update(
                        kl=est.as_dict(), language_kl=lang.as_dict(),
                        stability=stability_curve(ids, target, lp))
                continue
            if name not in case["methods"]:
                continue  # scored only as a reference (masking when not requested)
            case["methods"][name].update(kl=est.as_dict(), language_kl=lang.as_dict(),
                                         stability=stability_curve(ids, target, lp))
        if curve:
            case["asap_curve"] = [curve[k] for k in sorted(curve)]
        _fill_fit_details(out, case)
        case.setdefault("support", {})["size"] = int(np.unique(ids[ids >= 0]).size)
    write_report(report, out, plots=plots)
    return report


_FIT_KEYS = ("falls_back_to_masking", "heldout_kl_gain", "heldout_kl_gain_se", "decision")


def _fill_fit_details(out: Path, case: dict) -> None:
    """Reports written before the fit's held-out decision was copied into them: read it from
    the controller artefacts' manifests (``controllers/<case>/<method>/manifest.json``)."""
    import json

    for name, info in case["methods"].items():
        manifest = out / "controllers" / case["name"] / name / "manifest.json"
        if "fit_seconds" not in info or all(k in info for k in _FIT_KEYS) or \
                not manifest.exists():
            continue
        training = json.loads(manifest.read_text()).get("training", {})
        info.update({k: training[k] for k in _FIT_KEYS if k in training})
        info.setdefault("target", training.get("target", "final"))
