"""The main job on the embedded default: masking versus SHIM on the shipped LM.

Fits each controller kind on one set of unconstrained samples for a built-in grammar, then
shows the difference: for a finite language (binary5) the *exact* distribution of masking and
of each controller against the exact target p(x | G); otherwise KL estimated on the support of
valid unconstrained samples. Also times constrained sampling per method, and writes a table
(markdown + JSON) and a PNG plot of the distributions against the target.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from shim_adapters.backends.registry import backends, get_backend
from shim_adapters.evaluation.exact_distribution import enumerate_language
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.loading import load_lm
from shim_adapters.shim.correction import ShimAdjuster, sample_with_shim
from shim_adapters.shim.fitting import fit_controller
from shim_adapters.shim.training_data import sample_training_data

CONTROLLER_KINDS = ("LR_NT", "LR_FULL", "MLP")


@dataclass
class DemoResult:
    grammar: str
    backend: str
    n_train: int
    rows: list[dict] = field(default_factory=list)
    distributions: dict[str, dict[str, float]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"grammar `{self.grammar}`, backend `{self.backend}`, shipped LM, "
                 f"{self.n_train} training samples",
                 "", "| method | exact KL(target ‖ method) | masking KL / method KL | β | ms / sample |",
                 "|---|---|---|---|---|"]
        base = next(r["kl"] for r in self.rows if r["method"] == "masking")
        for r in self.rows:
            ratio = base / r["kl"] if r["kl"] > 0 else float("inf")
            beta = "-" if r.get("beta") is None else f"{r['beta']:g}"
            lines.append(f"| {r['method']} | {r['kl']:.4f} | {ratio:.2f} |"
                         f" {beta} | {r['ms_per_sample']:.1f} |")
        return "\n".join(lines)


def _default_backend() -> str:
    available = backends()
    for name in ("syncode", "xgrammar", "outlines"):
        if name in available:
            return name
    if not available:
        raise RuntimeError("no masker backend is installed: pip install -r requirements.txt")
    return next(iter(available))


def _ms_per_sample(lm, masker, controller, prompt: str, n: int, seed: int) -> float:
    start = time.perf_counter()
    out = sample_with_shim(lm, masker, controller, prompt, n, max_new_tokens=16, seed=seed)
    elapsed = time.perf_counter() - start
    if not all(out.complete):
        raise RuntimeError("a constrained sample did not finish within 16 tokens")
    return 1000.0 * elapsed / n


def plot_distributions(distributions: dict[str, dict[str, float]], path: Path,
                       title: str) -> None:
    """Grouped bars: target, masking and each controller over the language's strings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strings = list(distributions["target"])
    methods = list(distributions)
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    x = np.arange(len(strings))
    for i, method in enumerate(methods):
        ax.bar(x + (i - (len(methods) - 1) / 2) * width,
               [distributions[method][s] for s in strings], width, label=method)
    ax.set_xticks(x, strings, rotation=60, fontfamily="monospace")
    ax.set_ylabel("probability")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(grammar: str = "binary5", backend: str | None = None, n_train: int = 2000,
             kinds: Sequence[str] = CONTROLLER_KINDS, n_timing: int = 100, seed: int = 0,
             out_dir: str | Path = "runs/demo", progress: bool = True) -> DemoResult:
    """Fit every controller kind on the shipped LM and compare with masking, exactly."""
    import torch

    torch.set_num_threads(1)
    backend = backend or _default_backend()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_lm(None)
    g = builtin_grammar(grammar)
    masker = get_backend(backend).compile(g, lm.tokenizer, lm.vocab_size)
    prompt = g.default_prompt
    data = sample_training_data(lm, masker, prompt, n_train, seed=seed, progress=progress)
    controllers = {}
    for kind in kinds:
        controller, _ = fit_controller(lm, masker, prompt, kind=kind, data=data,
                                       output_dir=out / f"controller-{kind}", progress=progress)
        controllers[kind] = controller
    exact = enumerate_language(lm, masker, prompt,
                               {kind: ShimAdjuster(c) for kind, c in controllers.items()})
    result = DemoResult(grammar=grammar, backend=backend, n_train=n_train)
    _ms_per_sample(lm, masker, None, prompt, 8, seed)  # warm caches before timing anything
    result.distributions["target"] = exact.by_string(exact.target())
    for method in ("masking", *kinds):
        controller = controllers.get(method)
        result.distributions[method] = exact.by_string(exact.method(method))
        result.rows.append({
            "method": method, "kl": exact.kl(method),
            "beta": None if controller is None else float(getattr(controller, "beta_", 1.0)),
            "ms_per_sample": _ms_per_sample(lm, masker, controller, prompt, n_timing, seed + 1),
        })
    plot = out / f"{grammar}_distributions.png"
    plot_distributions(result.distributions, plot,
                       f"{grammar}: exact distributions on the shipped LM ({backend})")
    (out / "demo.json").write_text(json.dumps(
        {"grammar": grammar, "backend": backend, "n_train": n_train, "rows": result.rows,
         "distributions": result.distributions}, indent=2))
    (out / "demo.md").write_text(result.markdown() + "\n")
    result.files = [str(plot), str(out / "demo.json"), str(out / "demo.md")]
    return result
