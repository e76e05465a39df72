"""Write an :class:`~.runner.EvalReport` as JSON, markdown and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from shim_adapters.evaluation.mixture import MIN_ESS, format_kl

SHIM_METHODS = ("lr_nt", "lr_full", "mlp")
#: Below this many valid draws a bootstrap interval of the language KL is not reported as
#: significant (it resamples a handful of target samples).
MIN_VALID_FOR_CI = 10


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if math.isinf(x):
            return "∞"
        if math.isnan(x):
            return "nan"
        if x != 0 and (abs(x) < 10 ** -digits or abs(x) >= 1e5):
            return f"{x:.2e}"
        return f"{x:.{digits}f}"
    return str(x)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def write_report(report, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """``report.json``, ``report.md`` and (with ``plots``) PNGs into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(_jsonable(report.as_dict()), indent=1,
                                        ensure_ascii=False))
    figures = write_plots(report, out) if plots else {}
    paths.update(figures)
    paths["markdown"].write_text(markdown(report, figures))
    return paths


def _kl(case: dict, method: str) -> dict | None:
    return case["methods"].get(method, {}).get("kl")


def markdown(report, figures: dict[str, Path] | None = None) -> str:
    r = report
    o = r.options
    methods = [m for m in r.methods]
    kl_methods = [m for m in methods if m != "rejection"]
    lines = [f"# SHIM evaluation: suite `{r.suite}`", ""]
    lines += [f"- LM: `{r.lm['identifier']}` (revision `{r.lm['revision'][:12]}`, logits width "
              f"{r.lm['vocab_size']})",
              f"- backend: `{r.backend['name']}` {r.backend['version']}",
              f"- N = {o['n_samples']} unconstrained draws per case for the support"
              + (" (each cut at the first token the masker refuses)" if o.get("cut_draws")
                 else "")
              + (f"; SHIM: the given controller `{o['controller_dir']}` (no refit); "
                 if o.get("controller_dir") else
                 f"; SHIM fitted once on {o['fit_prompts']['size']} prompts "
                 f"(`{o['fit_prompts']['source']}`, sha256 {o['fit_prompts']['sha256'][:12]}), "
                 f"{o['n_train'] or o['n_samples']} draws spread over them; "
                 if o.get("fit_prompts") else
                 f"; SHIM trained on {o['n_train'] or o['n_samples']} separate draws; "
                 if any(m in methods for m in SHIM_METHODS) else "; ")
              + (f"ASAp after {o['asap_samples']} samples (trie updated every "
                 f"{o['asap_batch_size']}); " if "asap" in methods else "")
              + f"{o['timing_samples']} samples per method for timing; seed {o['seed']}; "
              f"{o['n_bootstrap']} bootstrap resamples",
              f"- command: `{r.command}`",
              "- KL is in nats. *Support KL* (the paper's): over the distinct valid draws S, both "
              "distributions renormalised over S; the CI resamples S with replacement. "
              "*Language KL*: KL(p(·|G) ‖ q) over the whole language, "
              "E[log p(x) − log P(L) − log q(x)] over the valid draws (exact samples of "
              "p(·|G)), P(L) = their fraction; the CI resamples all N draws. Renormalising over "
              "S hides the mass a method puts outside S; the language KL counts it",
              f"- wall time {r.seconds / 60:.1f} min, peak RSS {r.peak_rss_mib:.0f} MiB", ""]
    lines += _importance_tables(r)
    lines += ["## KL(p(·|G) ‖ q) over the sampled support S (nats, 95% bootstrap CI)", "",
              "| case | \\|S\\| | " + " | ".join(kl_methods) + " |",
              "|---|---:|" + "---:|" * len(kl_methods)]
    for case in r.cases:
        lines.append(f"| {case['name']} | {case['support']['size']} | "
                     + _ci_cells(case, kl_methods, _kl, 4) + " |")
    lines += ["", "### KL of masking divided by KL of each method (>1: the method is closer to "
              "the target)", "",
              "| case | " + " | ".join(m for m in kl_methods if m != "masking") + " |",
              "|---|" + "---:|" * (len(kl_methods) - 1)]
    for case in r.cases:
        base = _kl(case, "masking")
        cells = []
        for m in kl_methods:
            if m == "masking":
                continue
            k = _kl(case, m)
            if not base or not k or not k["kl"]:
                cells.append("—")
            else:
                cells.append(_fmt(base["kl"] / k["kl"], 2))
        lines.append(f"| {case['name']} | " + " | ".join(cells) + " |")
    lines += _language_kl_tables(r, kl_methods)
    lines += ["", "## Mean seconds per sample (one sample at a time; rejection: per accepted "
              "sample)", "",
              "| case | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for case in r.cases:
        cells = [_fmt(case.get("timing", {}).get(m, {}).get("seconds_per_sample"), 4)
                 for m in methods]
        lines.append(f"| {case['name']} | " + " | ".join(cells) + " |")
    rej = [c for c in r.cases if "rejection" in c["methods"]]
    if rej:
        lines += ["", "Rejection sampling measured on the N batched draws (the exact target's "
                  "price):", "", "| case | acceptance rate | s per accepted sample |",
                  "|---|---:|---:|"]
        for case in rej:
            m = case["methods"]["rejection"]
            lines.append(f"| {case['name']} | {_fmt(m['acceptance_rate'], 3)} | "
                         f"{_fmt(m['batched_seconds_per_accepted'], 3)} |")
    lines += ["", "Mean tokens per sample (EOS included):", "",
              "| case | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    for case in r.cases:
        cells = [_fmt(case.get("timing", {}).get(m, {}).get("tokens_per_sample"), 1)
                 for m in methods]
        lines.append(f"| {case['name']} | " + " | ".join(cells) + " |")
    lines += ["", "Relative to masking:", "", "| case | " + " | ".join(methods) + " |",
              "|---|" + "---:|" * len(methods)]
    for case in r.cases:
        t = case.get("timing", {})
        base = t.get("masking", {}).get("seconds_per_sample")
        cells = [_fmt(t[m]["seconds_per_sample"] / base, 2) if base and m in t else "—"
                 for m in methods]
        lines.append(f"| {case['name']} | " + " | ".join(cells) + " |")

    exact_cases = [c for c in r.cases if c.get("exact") and "kl" in c["exact"]]
    if exact_cases:
        lines += ["", "## Exact KL over the whole (finite) language", ""]
        for case in exact_cases:
            ex = case["exact"]
            lines += [f"### {case['name']} ({ex['n_sequences']} token sequences)", "",
                      "| method | exact KL | mass on language |", "|---|---:|---:|"]
            for m, v in ex["kl"].items():
                lines.append(f"| {m} | {_fmt(v)} | {_fmt(ex['total_mass'][m])} |")
            strings = sorted(ex["target_by_string"])
            cols = list(ex["by_string"])
            lines += ["", "| string | target | " + " | ".join(cols) + " |",
                      "|---|---:|" + "---:|" * len(cols)]
            for s in strings:
                lines.append(f"| `{s}` | {_fmt(ex['target_by_string'][s], 3)} | " + " | ".join(
                    _fmt(ex["by_string"][m].get(s, 0.0), 3) for m in cols) + " |")
            lines.append("")

    curves = [c for c in r.cases if c.get("asap_curve")]
    if curves:
        lines += ["", "## ASAp: KL against the number of ASAp samples", "",
                  "| case | " + " | ".join(f"{p['samples']}" for p in curves[0]["asap_curve"])
                  + " |", "|---|" + "---:|" * len(curves[0]["asap_curve"])]
        for case in curves:
            lines.append(f"| {case['name']} | " + " | ".join(
                _fmt(p["kl"]) for p in case["asap_curve"]) + " |")
        lines += ["", "ASAp memory (its trie after the ASAp samples; grows with every token "
                  "sampled):", "", "| case | nodes | KiB | bytes/token | KiB/sample |",
                  "|---|---:|---:|---:|---:|"]
        for case in curves:
            a = case["methods"]["asap"]
            lines.append(f"| {case['name']} | {a['trie_nodes']} | {a['trie_bytes'] / 1024:.1f} |"
                         f" {a['trie_bytes_per_token']:.0f} | "
                         f"{a['trie_bytes_per_sample'] / 1024:.2f} |")

    shim_cases = [c for c in r.cases if any(m in c["methods"] and "fit_seconds" in
                                            c["methods"][m] for m in SHIM_METHODS)]
    if shim_cases:
        lines += ["", "## SHIM controllers", "", "β is fitted on held-out training "
                  "completions; β = 0 (plain masking) when the held-out KL gain over masking "
                  "is not above 1 SE.", "", "| case | controller | target | β | held-out gain "
                  "± SE (nats) | fit s | training draws | sampling s | artefact KiB |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for case in shim_cases:
            for m in SHIM_METHODS:
                info = case["methods"].get(m)
                if info and "fit_seconds" in info:
                    gain = (f"{info['heldout_kl_gain']:.3g} ± {info['heldout_kl_gain_se']:.2g}"
                            + (" (fell back)" if info["falls_back_to_masking"] else "")
                            if "heldout_kl_gain" in info else "—")
                    lines.append(f"| {case['name']} | {m} | {info.get('target', 'final')} | "
                                 f"{_fmt(info['beta'], 2)} | {gain} | "
                                 f"{info['fit_seconds']:.1f} | {info['training_samples']} | "
                                 f"{info['training_sample_seconds']:.1f} | "
                                 f"{info['controller_bytes'] / 1024:.1f} |")

    lines += ["", "## Per-phase timings (µs per call, one sample at a time)", ""]
    for case in r.cases:
        lines += [f"### {case['name']} (compile {case['compile_seconds']:.2f} s)", "",
                  "| method | phase | calls | p50 | p95 | p99 |", "|---|---|---:|---:|---:|---:|"]
        for m, t in case.get("timing", {}).items():
            for phase, s in t["phases"].items():
                if phase == "compile":
                    continue
                lines.append(f"| {m} | {phase} | {s['calls']} | {s['p50_us']:.1f} | "
                             f"{s['p95_us']:.1f} | {s['p99_us']:.1f} |")
        lines.append("")

    lines += ["## Support and caveats", "", "| case | draws | valid | distinct valid | "
              "truncated | valid but refused by the masker | prompt tokens | ends at newline |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for case in r.cases:
        s = case["support"]
        lines.append(f"| {case['name']} | {s['n_draws']} | {s['valid_draws']} | "
                     f"{s['distinct_valid']} | {s['truncated_draws']} | "
                     f"{s['masker_rejected_valid']} | {case['prompt_tokens']} | "
                     f"{'yes' if case.get('stop_at_newline') else 'no'} |")
    broken = [(c["name"], c["methods"]["asap"]) for c in r.cases
              if c["methods"].get("asap", {}).get("masker_errors")]
    if broken:
        lines += ["", "ASAp samples dropped because the masker refused a token its own mask "
                  "allowed (a backend inconsistency; the sample stops, never unconstrained):", ""]
        for name, a in broken:
            lines.append(f"- {name}: {a['masker_errors']} sample(s), e.g. "
                         f"`{a['masker_error_example']}`")
    refused = [(c["name"], c["support"]["masker_rejected_examples"]) for c in r.cases
               if c["support"]["masker_rejected_examples"]]
    if refused:
        lines += ["", "Valid strings the masker refuses are left out of S (every masked method "
                  "gives them probability 0, so KL over them would be infinite):", ""]
        for name, examples in refused:
            lines.append(f"- {name}: " + "; ".join(f"`{e!r}`" for e in examples))
    if figures:
        lines += ["", "## Plots", ""]
        for name, path in figures.items():
            lines.append(f"![{name}]({Path(path).name})")
    return "\n".join(lines) + "\n"


def _importance_methods(case: dict) -> list[str]:
    return list(case.get("importance", {}).get("kl", {}))


def _label(method: str) -> str:
    return "asap" if method.startswith("asap@") else method


def _importance_tables(r) -> list[str]:
    """KL at any P(L): the importance-sampled estimates over the pooled proposals."""
    cases = [c for c in r.cases if c.get("importance")]
    if not cases:
        return []
    methods = []
    for c in cases:
        methods += [m for m in _importance_methods(c) if m not in methods]
    lines = ["## KL(p(·|G) ‖ q) by importance sampling (nats, 95% stratified bootstrap CI)", "",
             "Every masked method draws its own samples; the pooled draws (with the "
             "unconstrained ones) are weighted by the balance heuristic "
             "w = 1[x in L]·p(x) / Σ_m (n_m/N)·q_m(x), so every method is scored on the same "
             "weighted samples of p(·|G) and P(L) = mean w. ESS = (Σw)²/Σw²; below "
             f"{MIN_ESS:g} a KL is not measurable and is not printed as a number.", "",
             "| case | P(L) | ESS / draws | " + " | ".join(_label(m) for m in methods) + " |",
             "|---|---:|---:|" + "---:|" * len(methods)]
    for c in cases:
        imp = c["importance"]
        cells = [format_kl(imp["kl"].get(m, float("nan")), imp["kl_ci"].get(m), imp["ess"])
                 if m in imp["kl"] else "—" for m in methods]
        lines.append(f"| {c['name']} | {_fmt(imp['p_valid'], 4)} | {imp['ess']:.0f} / "
                     f"{imp['n_draws']} | " + " | ".join(cells) + " |")
    others = [m for m in methods if m != "masking"]
    lines += ["", "### Each method minus masking (paired on the same weighted draws; * the 95% "
              "CI excludes 0)", "", "| case | " + " | ".join(_label(m) for m in others) + " |",
              "|---|" + "---:|" * len(others)]
    for c in cases:
        imp = c["importance"]
        cells = []
        for m in others:
            d, ci = imp["diff_to_masking"].get(m), imp["diff_ci"].get(m)
            if d is None or not imp["ess"] >= MIN_ESS or ci is None:
                cells.append("—" if d is None else f"not measurable (ESS {imp['ess']:.3g})")
                continue
            star = "*" if ci[1] < 0 or ci[0] > 0 else ""
            cells.append(f"{d:+.3f}{star} [{ci[0]:+.3f}, {ci[1]:+.3f}]")
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    pair_names = []
    for c in cases:
        pair_names += [p for p in c["importance"].get("paired", {}) if p not in pair_names]
    if pair_names:
        lines += ["", "### The given controller minus the case's own fit (KL difference, paired "
                  "on the same weighted draws; negative: the given controller is closer to the "
                  "target; * the 95% CI excludes 0)", "",
                  "| case | " + " | ".join(pair_names) + " |", "|---|" + "---:|" * len(pair_names)]
        for c in cases:
            imp, cells = c["importance"], []
            for p in pair_names:
                entry = imp.get("paired", {}).get(p)
                if entry is None or not imp["ess"] >= MIN_ESS:
                    cells.append("—" if entry is None else
                                 f"not measurable (ESS {imp['ess']:.3g})")
                    continue
                lo, hi = entry["ci"]
                star = "*" if hi < 0 or lo > 0 else ""
                cells.append(f"{entry['diff']:+.3f}{star} [{lo:+.3f}, {hi:+.3f}]")
            lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    lines += ["", "### SHIM fits, exact-target mode and cost", "",
              "| case | target (P(L) estimate) | LR_FULL β | fell back | exact-target ESS "
              "(LR_FULL proposal) | s / effective sample | " + " | ".join(
                  f"{_label(m)} s/sample" for m in methods) + " | rejection LM tokens / valid |",
              "|---|---|---:|---|---:|---:|" + "---:|" * len(methods) + "---:|"]
    for c in cases:
        imp = c["importance"]
        fit = c["methods"].get("lr_full", {})
        et = imp.get("exact_target", {})
        rej = c["methods"].get("rejection", {})
        cost = imp.get("cost", {})
        lines.append(
            f"| {c['name']} | {fit.get('target', '—')} ({_fmt(fit.get('p_valid_estimate'), 3)})"
            f" | {_fmt(fit.get('beta'), 2)} | {fit.get('falls_back_to_masking', '—')} | "
            f"{_fmt(et.get('ess'), 1)} | {_fmt(et.get('seconds_per_effective_sample'), 2)} | "
            + " | ".join(_fmt(cost.get(m, {}).get("seconds_per_sample"), 3) for m in methods)
            + f" | {_fmt(rej.get('forward_tokens_per_valid_sample'), 0)} |")
    return lines + [""]


def _lang(case: dict, method: str) -> dict | None:
    return case["methods"].get(method, {}).get("language_kl")


def _ci_cells(case: dict, methods: list[str], getter, digits: int) -> str:
    """``value [low, high]`` per method, joined as markdown cells."""
    cells = []
    for m in methods:
        k = getter(case, m)
        cells.append("—" if not k else f"{_fmt(k['kl'], digits)} [{_fmt(k['ci_low'], digits)}, "
                                       f"{_fmt(k['ci_high'], digits)}]")
    return " | ".join(cells)


def _language_kl_tables(r, kl_methods: list[str]) -> list[str]:
    """The whole-language KL and each method's paired difference to masking."""
    if not any(_lang(c, m) for c in r.cases for m in kl_methods):
        return []
    lines = ["", "## KL(p(·|G) ‖ q) over the whole language (Monte-Carlo; nats, 95% bootstrap "
             "CI)", "", "| case | valid draws | " + " | ".join(kl_methods) + " |",
             "|---|---:|" + "---:|" * len(kl_methods)]
    for case in r.cases:
        n_valid = next((k["n_valid"] for m in kl_methods if (k := _lang(case, m))), "—")
        lines.append(f"| {case['name']} | {n_valid} | " + _ci_cells(case, kl_methods, _lang, 3)
                     + " |")
    others = [m for m in kl_methods if m != "masking"]
    if others:
        lines += ["", "### Language KL of each method minus masking's (paired per draw; "
                  "negative: closer to the target than masking; * the 95% CI excludes 0)", "",
                  "| case | " + " | ".join(others) + " |", "|---|" + "---:|" * len(others)]
        for case in r.cases:
            cells = []
            for m in others:
                k = _lang(case, m)
                if not k or k.get("diff") is None or math.isnan(k["diff"]):
                    cells.append("—")
                    continue
                star = ("†" if k["n_valid"] < MIN_VALID_FOR_CI else
                        "*" if k["diff_ci_high"] < 0 or k["diff_ci_low"] > 0 else "")
                cells.append(f"{k['diff']:+.3f}{star} [{k['diff_ci_low']:+.3f}, "
                             f"{k['diff_ci_high']:+.3f}]")
            lines.append(f"| {case['name']} | " + " | ".join(cells) + " |")
        if any((k := _lang(c, "masking")) and k["n_valid"] < MIN_VALID_FOR_CI for c in r.cases):
            lines += ["", f"† fewer than {MIN_VALID_FOR_CI} valid draws: the bootstrap resamples "
                      "too few target samples for the interval to mean anything."]
    return lines


def write_plots(report, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: dict[str, Path] = {}
    methods = [m for m in report.methods if m != "rejection"]
    cases = report.cases
    if not cases:
        return figures

    for key, getter, label in (("kl_per_case", _kl, "support KL (paper)"),
                               ("language_kl_per_case", _lang, "language KL")):
        if any(getter(c, m) for c in cases for m in methods):
            figures[key] = _kl_bar_plot(plt, report, methods, getter, label, out / f"{key}.png")
    _other_plots(plt, report, methods, figures, out)
    return figures


def _kl_bar_plot(plt, report, methods, getter, label: str, path: Path) -> Path:
    cases = report.cases
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases) * len(methods) / 3), 4))
    width = 0.8 / max(1, len(methods))
    x = np.arange(len(cases))
    for j, m in enumerate(methods):
        vals, lo, hi = [], [], []
        for c in cases:
            k = getter(c, m)
            v = k["kl"] if k and math.isfinite(k["kl"]) else np.nan
            vals.append(max(v, 1e-6) if not np.isnan(v) else np.nan)
            lo.append(max(v - (k["ci_low"] if k else v), 0) if not np.isnan(v) else 0)
            hi.append(max((k["ci_high"] if k and math.isfinite(k["ci_high"]) else v) - v, 0)
                      if not np.isnan(v) else 0)
        ax.bar(x + j * width, vals, width, yerr=[lo, hi], label=m, capsize=2)
    ax.set_xticks(x + width * (len(methods) - 1) / 2)
    ax.set_xticklabels([c["name"] for c in cases], rotation=30, ha="right", fontsize=8)
    _log_scale_if_positive(ax, [p.get_height() for p in ax.patches])
    ax.set_ylabel(f"{label} [nats]")
    ax.set_title(f"{label} per case ({report.lm['identifier']}, {report.backend['name']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _other_plots(plt, report, methods, figures: dict[str, Path], out: Path) -> None:
    cases = report.cases

    # distortion figure for finite languages
    for c in cases:
        ex = c.get("exact")
        if not ex or "kl" not in ex:
            continue
        strings = sorted(ex["target_by_string"], key=lambda s: -ex["target_by_string"][s])
        cols = ["target"] + list(ex["by_string"])
        fig, ax = plt.subplots(figsize=(max(7, 0.5 * len(strings)), 4))
        w = 0.8 / len(cols)
        xs = np.arange(len(strings))
        for j, col in enumerate(cols):
            src = ex["target_by_string"] if col == "target" else ex["by_string"][col]
            label = col if col == "target" else f"{col} (KL {_fmt(ex['kl'][col], 3)})"
            ax.bar(xs + j * w, [src.get(s, 0.0) for s in strings], w, label=label)
        ax.set_xticks(xs + w * (len(cols) - 1) / 2)
        ax.set_xticklabels(strings, rotation=60, fontsize=8, family="monospace")
        ax.set_ylabel("probability")
        ax.set_title(f"{c['name']}: distribution over the language (exact)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        key = f"distortion_{c['name']}"
        figures[key] = out / f"{key}.png"
        fig.savefig(figures[key], dpi=110)
        plt.close(fig)

    # KL against |S|
    n = len(cases)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, c in zip(axes.flat, cases):
        for m in methods:
            curve = c["methods"].get(m, {}).get("stability")
            if curve:
                ax.plot([p["support_size"] for p in curve],
                        [p["kl"] if math.isfinite(p["kl"]) else np.nan for p in curve],
                        marker=".", label=m)
        ax.set_title(c["name"], fontsize=8)
        ax.set_xlabel("|S|", fontsize=7)
        ax.set_ylabel("KL", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    figures["kl_vs_support"] = out / "kl_vs_support.png"
    fig.savefig(figures["kl_vs_support"], dpi=110)
    plt.close(fig)

    # ASAp KL against samples
    curves = [c for c in cases if c.get("asap_curve")]
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in curves:
            pts = c["asap_curve"]
            line, = ax.plot([p["samples"] for p in pts],
                            [max(p["kl"], 1e-6) if math.isfinite(p["kl"]) else np.nan
                             for p in pts], marker="o", label=c["name"])
            best_shim = [(_kl(c, m) or {}).get("kl") for m in SHIM_METHODS if _kl(c, m)]
            if best_shim:
                ax.axhline(max(min(best_shim), 1e-6), color=line.get_color(), ls=":", lw=0.8)
        ax.set_xscale("symlog", linthresh=10)
        _log_scale_if_positive(ax, [y for ln in ax.get_lines() for y in ln.get_ydata()])
        ax.set_xlabel("ASAp samples")
        ax.set_ylabel("KL(p(·|G) ‖ q_ASAp)")
        ax.set_title("ASAp convergence (dotted: best SHIM controller)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        figures["asap_kl_vs_samples"] = out / "asap_kl_vs_samples.png"
        fig.savefig(figures["asap_kl_vs_samples"], dpi=110)
        plt.close(fig)


def _log_scale_if_positive(ax, values) -> None:
    """Log y-axis only when there is something positive to show (else matplotlib raises)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if np.any(np.isfinite(arr) & (arr > 0)):
        ax.set_yscale("log")
