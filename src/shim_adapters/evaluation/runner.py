"""``run_eval``: every method on every case of a suite, scored by the paper's protocol.

Per case: compile the grammar; draw N unconstrained LM samples (the valid ones are the support
S and, kept, rejection sampling's output); fit the SHIM controllers on a *separate* draw
(another seed); run ASAp for ``asap_samples`` samples, keeping snapshots of its trie; score
every distinct sequence of S exactly under the LM and each method in one teacher-forced pass;
KL with a bootstrap CI and its curve as |S| grows; the exact KL over the whole language for
small finite languages; then time every method by drawing a few samples one at a time
through one instrumented loop (so per-phase costs compare like with like).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.asap import run_asap
from shim_adapters.evaluation.exact_language import LanguageTooLargeError, enumerate_language
from shim_adapters.evaluation.metrics import (
    bootstrap_kl,
    exact_kl,
    grouped_probabilities,
    language_kl,
    stability_curve,
    support_of,
)
from shim_adapters.evaluation.mixture import MixtureDraws, mixture_kl
from shim_adapters.evaluation.rejection import draw_lm_samples
from shim_adapters.evaluation.report import write_report
from shim_adapters.evaluation.scoring import MASKING, score_sequences
from shim_adapters.evaluation.suites import EvalCase, Suite, load_suite
from shim_adapters.evaluation.timing import PhaseTimer, peak_rss_mib
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.loading import load_lm
from shim_adapters.lm.sampling import eos_ids, sample
from shim_adapters.mask.protocol import Masker
from shim_adapters.shim.artefact import (
    load_controller,
    read_manifest,
    warn_if_prompt_outside,
)
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.fitting import (
    FitRecipe,
    InProcessRollouts,
    PreparedPrompt,
    draw_first,
    fit_with_recipe,
    prepare_prompt,
)
from shim_adapters.shim.prompt_set import PromptSet, fitted_on
from shim_adapters.shim.targets import TARGET_KINDS

#: Method names, in report order. ``rejection`` is the exact target (KL 0 by construction).
METHODS = ("masking", "lr_nt", "lr_full", "mlp", "asap", "rejection")
SHIM_KINDS = {"lr_nt": "LR_NT", "lr_full": "LR_FULL", "mlp": "MLP"}
#: The method name a controller of each kind is reported under.
KIND_METHODS = {kind: name for name, kind in SHIM_KINDS.items()}
#: Suffix of a case's own SHIM fit when a given controller is scored beside it.
OWN_FIT = "_own"


def _is_shim(method: str) -> bool:
    return method in SHIM_KINDS or method.removesuffix(OWN_FIT) in SHIM_KINDS


@dataclass
class EvalOptions:
    """Sizes and knobs of one evaluation run (everything but suite/LM/backend/methods)."""

    n_samples: int = 1000
    seed: int = 0
    #: Completions the SHIM controllers are fitted on (None: n_samples).
    n_train: int | None = None
    #: SHIM training labels (:mod:`shim_adapters.shim.targets`): ``final`` (the paper's 0/1 validity
    #: of unconstrained completions), ``rollout`` or ``bootstrap`` (masked completions).
    target: str = "final"  # or "auto", "rollout", "bootstrap"
    #: Iterated refits within the SHIM training budget (``fit_controller(rounds=...)``).
    rounds: int = 1
    #: Cap on SHIM's LM samples per problem: a fit not trusted only for want of held-out
    #: evidence tops up to it (``fit_controller(max_samples=...)``); None: no top-ups.
    max_train: int | None = None
    #: Samples per masked method for the importance-sampled KL (0: rejection-based only).
    mixture_samples: int = 0
    asap_samples: int = 100
    #: ASAp samples drawn between trie updates (1 = the sequential algorithm).
    asap_batch_size: int = 1
    asap_checkpoints: tuple[int, ...] = (0, 10, 30, 100)
    #: Samples drawn one at a time per method to time it.
    timing_samples: int = 20
    n_bootstrap: int = 200
    #: Overrides each case's max_new_tokens when set.
    max_new_tokens: int | None = None
    batch_size: int = 64
    #: Stop an unconstrained draw at the first token the masker refuses (saves the steps of
    #: hopeless draws; S is unchanged when the masker is sound, but valid strings the masker
    #: wrongly refuses can then no longer be counted).
    cut_draws: bool = False
    data_dir: str | None = None
    cases: tuple[str, ...] | None = None
    limit: int | None = None
    #: Keep the cases already in ``out_dir/report.json`` and run only the others.
    resume: bool = False
    #: Wrap each case's prompt in the LM's chat template (instruct LMs).
    chat: bool = False
    #: The SHIM fit's recipe (``shim eval`` builds it as ``shim fit`` does); None: one from
    #: ``target``, ``rounds``, ``max_train``, ``chat`` and ``batch_size``. Per case its kind,
    #: seed (``seed + 1``: a draw separate from the support's) and ``max_new_tokens`` are set.
    recipe: FitRecipe | None = None
    #: Score this artefact (``shim fit --out DIR``) instead of fitting: no refit.
    controller_dir: str | None = None
    #: Fit once on these prompts and score every case with that controller.
    fit_prompts: PromptSet | None = None
    #: With ``controller_dir`` or ``fit_prompts``: every case also fits its own SHIM
    #: controllers (methods ``<kind>_own``), so the given controller is compared with a
    #: per-prompt fit on the same weighted draws (``importance.paired``).
    own_fits: bool = False

    def fit_recipe(self, kind: str, max_new_tokens: int,
                   stop_at_newline: bool | str) -> FitRecipe:
        """The recipe a case's fit runs (one place for every SHIM kind and case)."""
        base = self.recipe if self.recipe is not None else FitRecipe(
            n_samples=self.n_train or self.n_samples, target=self.target, rounds=self.rounds,
            max_samples=self.max_train, chat=self.chat, batch_size=self.batch_size)
        if base.stop_at_newline != "auto":  # asked for on the command line: every case
            stop_at_newline = base.stop_at_newline
        return replace(base, kind=kind, seed=self.seed + 1, max_new_tokens=max_new_tokens,
                       stop_at_newline=stop_at_newline, progress=False)

    def as_dict(self) -> dict:
        out = {}
        for k, v in self.__dict__.items():
            if isinstance(v, FitRecipe):
                v = {**asdict(v), "controller_params": dict(v.controller_params)}
            elif isinstance(v, PromptSet):
                v = {key: val for key, val in v.record().items() if key != "prompt_sha256"}
            out[k] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass
class EvalReport:
    """The results of :func:`run_eval` (write with :func:`~.report.write_report`)."""

    suite: str
    lm: dict[str, str]
    backend: dict[str, str]
    methods: list[str]
    options: dict[str, Any]
    cases: list[dict[str, Any]] = field(default_factory=list)
    command: str = ""
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    out_dir: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, path: str | Path) -> "EvalReport":
        """Read a ``report.json`` back (non-finite floats are stored as strings there)."""
        import json

        def restore(obj):
            if isinstance(obj, dict):
                return {k: restore(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [restore(v) for v in obj]
            if obj in ("inf", "-inf", "nan"):
                return float(obj)
            return obj

        return cls(**restore(json.loads(Path(path).read_text())))

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per case: KL and seconds per sample for each method."""
        rows = []
        for case in self.cases:
            row = {"case": case["name"], "support": case["support"]["size"]}
            for m in self.methods:
                res = case["methods"].get(m, {})
                row[f"{m}_kl"] = res.get("kl", {}).get("kl") if res.get("kl") else None
                row[f"{m}_s_per_sample"] = res.get("seconds_per_sample")
            rows.append(row)
        return rows


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"[eval {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_eval(suite: str | Path | Suite, lm_spec: str | None = None, backend: str = "xgrammar",
             methods: Sequence[str] = METHODS, n_samples: int = 1000, seed: int = 0,
             out_dir: str | Path | None = None, progress: bool = True, **options: Any
             ) -> EvalReport:
    """Evaluate ``methods`` on every case of ``suite`` with the LM ``lm_spec`` (None: shipped
    tiny LM; ``"smollm2"``; a model directory or .gguf) and masker ``backend``.

    ``options`` are :class:`EvalOptions` fields (``n_train``, ``asap_samples``,
    ``asap_batch_size``, ``asap_checkpoints``, ``timing_samples``, ``n_bootstrap``,
    ``max_new_tokens``, ``batch_size``, ``data_dir``, ``cases``, ``limit``). With ``out_dir``
    the report (JSON, markdown, PNG plots) and the fitted controllers are written there.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    opts = EvalOptions(n_samples=n_samples, seed=seed, **options)
    if opts.controller_dir is not None and opts.fit_prompts is not None:
        raise ValueError("give controller_dir (score an artefact) or fit_prompts (fit on a "
                         "prompt set), not both")
    if opts.own_fits and opts.controller_dir is None and opts.fit_prompts is None:
        raise ValueError("own_fits compares a given controller with per-prompt fits: give "
                         "controller_dir or fit_prompts too")
    if opts.controller_dir is not None:  # its kind stands in for the SHIM methods asked for
        kind = read_manifest(opts.controller_dir)["controller"]["kind"]
        shim = [m for m in methods if m in SHIM_KINDS]
        methods = [m for m in methods if m not in SHIM_KINDS]
        if shim:
            methods.insert(min(1, len(methods)), KIND_METHODS[kind])

    if opts.target not in TARGET_KINDS + ("auto",):
        raise ValueError(f"unknown SHIM target {opts.target!r}; choose from "
                         f"{', '.join(TARGET_KINDS)}")
    suite_obj = load_suite(suite, opts.data_dir).select(
        list(opts.cases) if opts.cases else None, opts.limit)
    start = time.perf_counter()
    lm = load_lm(lm_spec)
    spec = get_backend(backend)
    report = EvalReport(
        suite=suite_obj.name,
        lm={"spec": str(lm_spec), "identifier": lm.identifier, "revision": lm.revision,
            "vocab_size": str(lm.vocab_size)},
        backend={"name": spec.name, "version": spec.version},
        methods=list(methods), options=opts.as_dict(),
        command=" ".join(sys.argv), out_dir=str(out_dir) if out_dir else None)
    done: dict[str, dict] = {}
    if out_dir is not None and opts.resume and (Path(out_dir) / "report.json").is_file():
        previous = EvalReport.from_json(Path(out_dir) / "report.json")
        done = {c["name"]: c for c in previous.cases}
        report.cases.extend(previous.cases)
        _log(progress, f"resuming {out_dir}: {len(done)} case(s) already done")
    given: GivenControllers | None = None
    for i, case in enumerate(suite_obj.cases):
        if case.name in done:
            continue
        _log(progress, f"case {i + 1}/{len(suite_obj.cases)}: {case.name}")
        if given is None and (opts.controller_dir or opts.fit_prompts):
            given = given_controllers(case, lm, spec, list(methods), opts, progress,
                                      out_dir=Path(out_dir) if out_dir else None)
        report.cases.append(evaluate_case(case, lm, spec, list(methods), opts, progress,
                                          out_dir=Path(out_dir) if out_dir else None,
                                          given=given))
        report.seconds = time.perf_counter() - start
        report.peak_rss_mib = peak_rss_mib()
        if out_dir is not None:  # keep a usable report even if a later case fails

            write_report(report, out_dir, plots=False)
    if out_dir is not None:
        write_report(report, out_dir)
    return report


@dataclass
class GivenControllers:
    """Controllers every case scores instead of fitting its own (``shim eval --controller`` or
    ``--fit-prompts``), with the LM view they were fitted on."""

    controllers: dict[str, Any]  #: method name -> fitted controller
    info: dict[str, dict]  #: method name -> what the report says about it
    manifests: dict[str, dict]
    stop_at_newline: bool
    chat: bool


def given_controllers(case: EvalCase, lm, spec, methods: list[str], opts: EvalOptions,
                      progress: bool = False, out_dir: Path | None = None) -> GivenControllers:
    """Load ``opts.controller_dir``, or fit every SHIM kind of ``methods`` once on
    ``opts.fit_prompts`` (with the case's grammar, which every case of the run shares)."""
    masker = spec.compile(case.grammar, lm.tokenizer, lm.vocab_size)
    max_new = opts.max_new_tokens or case.max_new_tokens
    controllers, info, manifests = {}, {}, {}
    if opts.controller_dir is not None:
        controller, manifest = load_controller(opts.controller_dir, masker, lm)
        name = KIND_METHODS[controller.kind]
        controllers[name], manifests[name] = controller, manifest
        info[name] = {"given_controller": str(opts.controller_dir)}
    else:
        for name in [m for m in methods if m in SHIM_KINDS]:
            recipe = opts.fit_recipe(SHIM_KINDS[name], max_new, case.stop_at_newline)
            directory = (out_dir / "controllers" / "fit-prompts" / name) if out_dir else None
            t0 = time.perf_counter()
            controller, manifest = fit_with_recipe(lm, masker, recipe, opts.fit_prompts,
                                                   output_dir=directory)
            controllers[name], manifests[name] = controller, manifest
            info[name] = {"fitted_on_prompts": len(opts.fit_prompts),
                          "fit_seconds": time.perf_counter() - t0,
                          "training_samples": manifest["training"].get("lm_samples_total"),
                          "training_sample_seconds": float(
                              manifest["training"].get("data_sample_seconds") or 0.0)}
            _log(progress, f"  {name}: fitted on {len(opts.fit_prompts)} prompts in "
                           f"{info[name]['fit_seconds']:.1f}s ({controller.decision_})")
    prompting = [m.get("training", {}).get("prompting", {}) for m in manifests.values()]
    stops = {bool(p.get("stop_at_newline", False)) for p in prompting}
    if len(stops) > 1:
        raise ValueError("the given controllers were fitted on different LM views (answers "
                         "ending at a newline or not): evaluate them separately")
    for name, controller in controllers.items():
        info[name].update(_controller_info(controller, manifests[name]))
    return GivenControllers(controllers, info, manifests, stops.pop() if stops else False,
                            any(bool(p.get("chat", False)) for p in prompting))


def _controller_info(controller, manifest: dict) -> dict[str, Any]:
    training = manifest.get("training", {})
    return {"beta": float(controller.beta_), "reg": float(controller.reg_),
            "controller_bytes": int(manifest.get("weights_bytes", 0)),
            "falls_back_to_masking": bool(training.get("falls_back_to_masking", False)),
            "heldout_kl_gain": training.get("heldout_kl_gain"),
            "heldout_kl_gain_se": training.get("heldout_kl_gain_se"),
            "heldout_effective_samples": training.get("heldout_effective_samples"),
            "fallback_reason": training.get("fallback_reason"),
            "target": training.get("target"),
            "lm_samples_total": training.get("lm_samples_total"),
            "prompt_set": {k: v for k, v in (training.get("prompt_set") or {}).items()
                           if k != "prompt_sha256"} or None,
            "heldout_holds_out": training.get("heldout_holds_out", "completions"),
            "decision": training.get("decision")}


def evaluate_case(case: EvalCase, lm, spec, methods: list[str], opts: EvalOptions,
                  progress: bool = False, out_dir: Path | None = None,
                  given: GivenControllers | None = None) -> dict[str, Any]:
    """All methods on one case; returns the JSON-ready result. ``given``: controllers to score
    instead of fitting (their LM view, e.g. answers ending at a newline, is the case's)."""
    max_new = opts.max_new_tokens or case.max_new_tokens
    t_case = time.perf_counter()
    compile_timer = PhaseTimer()
    with compile_timer.phase("compile"):
        masker = spec.compile(case.grammar, lm.tokenizer, lm.vocab_size)
    # the prompt is prepared by the fit's own recipe, so every method sees the LM view (answers
    # ending at a newline or not, chat template) the controllers are fitted on
    recipe = opts.fit_recipe("LR_FULL", max_new, case.stop_at_newline)
    if given is not None:
        recipe = replace(recipe, stop_at_newline=given.stop_at_newline, chat=given.chat)
    prepared = prepare_prompt(lm, masker, case.prompt, recipe)
    base_lm, lm, pre = lm, prepared.lm, prepared.prefilled
    result: dict[str, Any] = {
        "name": case.name, "grammar": case.grammar.name, "grammar_sha256": case.grammar.sha256,
        "prompt_tokens": pre.length, "max_new_tokens": max_new,
        "stop_at_newline": prepared.stop_at_newline, "prompting": prepared.record,
        "compile_seconds": compile_timer.durations["compile"][0], "methods": {},
    }

    # 1. unconstrained draws: the support S (and rejection sampling's exact samples)
    gen = torch.Generator().manual_seed(opts.seed)
    draws = draw_lm_samples(pre, case.grammar, opts.n_samples, max_new_tokens=max_new,
                            batch_size=opts.batch_size, generator=gen, progress=progress,
                            cut_by=masker if opts.cut_draws else None)
    _log(progress, f"  {draws.n} LM samples in {draws.seconds:.1f}s, "
                   f"{int(draws.valid.sum())} valid, {int(draws.cut.sum())} cut by the masker")

    # 2. SHIM controllers, fitted on a separate draw
    adjusters: dict[str, Any] = {MASKING: None}  # always scored: ASAp@0 must equal it
    shim_info: dict[str, dict] = {}
    wanted_shim = [m for m in methods if m in SHIM_KINDS]
    if given is not None:
        for name, controller in given.controllers.items():
            adjusters[name] = ShimAdjuster(controller)
            inside = fitted_on(given.manifests[name], case.prompt)
            shim_info[name] = dict(given.info[name], prompt_in_fit_set=inside)
            warn_if_prompt_outside(given.manifests[name], case.prompt,
                                   opts.controller_dir or f"the {name} fit on --fit-prompts")
        if opts.own_fits:  # the case's own fits beside the given ones, on the same draws
            own_info: dict[str, dict] = {}
            own = _fit_shim(case, base_lm, prepared, masker, list(given.controllers), opts,
                            max_new, progress, own_info, out_dir)
            adjusters.update({f"{k}{OWN_FIT}": v for k, v in own.items()})
            shim_info.update({f"{k}{OWN_FIT}": v for k, v in own_info.items()})
    elif wanted_shim:
        adjusters.update(_fit_shim(case, base_lm, prepared, masker, wanted_shim, opts,
                                   max_new, progress, shim_info, out_dir))

    # 3. ASAp with snapshots of its trie
    asap_run = None
    if "asap" in methods:
        checkpoints = sorted(set(c for c in opts.asap_checkpoints if c <= opts.asap_samples)
                             | {opts.asap_samples})
        asap_timer = PhaseTimer()
        asap_run = run_asap(pre, masker, opts.asap_samples, checkpoints=checkpoints,
                            batch_size=opts.asap_batch_size, max_new_tokens=max_new,
                            generator=torch.Generator().manual_seed(opts.seed + 2),
                            timer=asap_timer)
        for k, snap in asap_run.snapshots.items():
            adjusters[f"asap@{k}"] = snap
        _log(progress, f"  ASAp: {opts.asap_samples} samples in {asap_run.seconds:.1f}s, "
                       f"{asap_run.trie.n_nodes} trie nodes")

    # 4. exact scoring of every distinct valid draw
    valid_seqs: dict[tuple[int, ...], int] = {}
    draw_ids = np.full(draws.n, -1, dtype=np.int64)
    for j, (ok, toks) in enumerate(zip(draws.valid, draws.token_ids)):
        if ok:
            draw_ids[j] = valid_seqs.setdefault(tuple(toks), len(valid_seqs))
    sequences = [list(k) for k in valid_seqs]
    t0 = time.perf_counter()
    scores = score_sequences(pre, sequences, masker, adjusters)
    score_seconds = time.perf_counter() - t0
    # valid strings the masker cannot produce (a backend bug or a tokenisation it refuses)
    unreachable = np.flatnonzero(~scores.masker_accepts)
    reachable_ids = draw_ids.copy()
    if unreachable.size:
        reachable_ids[np.isin(draw_ids, unreachable)] = -1
    result["support"] = {
        "n_draws": draws.n, "valid_draws": int(draws.valid.sum()),
        "size": int(support_of(reachable_ids).size),
        "distinct_valid": len(sequences),
        "truncated_draws": int((~draws.complete & ~draws.cut).sum()),
        "cut_draws": int(draws.cut.sum()),
        "masker_rejected_valid": int(unreachable.size),
        "masker_rejected_examples": [draws.texts[int(np.flatnonzero(draw_ids == u)[0])]
                                     for u in unreachable[:3]],
        "scoring_seconds": score_seconds,
    }
    target = scores.lm
    if out_dir is not None:  # the raw scores, so metrics can be recomputed without sampling
        from safetensors.numpy import save_file

        (out_dir / "scores").mkdir(parents=True, exist_ok=True)
        tensors = {"draw_ids": reachable_ids, "lm": target.astype(np.float64)}
        tensors.update({f"method.{k.replace('@', '_at_')}": v.astype(np.float64)
                        for k, v in scores.methods.items()})
        save_file(tensors, str(out_dir / "scores" / f"{case.name}.safetensors"))
    for name, lp in scores.methods.items():
        est = bootstrap_kl(reachable_ids, target, lp, n_bootstrap=opts.n_bootstrap,
                           seed=opts.seed)
        lang_est = language_kl(reachable_ids, target, lp, scores.methods[MASKING],
                               n_bootstrap=opts.n_bootstrap, seed=opts.seed)
        entry = {"kl": est.as_dict(), "language_kl": lang_est.as_dict(),
                 "stability": stability_curve(reachable_ids, target, lp)}
        if name.startswith("asap@"):
            result.setdefault("asap_curve", []).append(
                {"samples": int(name.split("@")[1]), **est.as_dict(),
                 "language_kl": lang_est.as_dict()})
            continue
        result["methods"][name] = entry
    if "asap" in methods:
        final = result["asap_curve"][-1]
        result["methods"]["asap"] = {
            "kl": {k: v for k, v in final.items() if k not in ("samples", "language_kl")},
            "language_kl": final["language_kl"],
            "stability": stability_curve(reachable_ids, target,
                                         scores.methods[f"asap@{opts.asap_samples}"]),
            "after_samples": opts.asap_samples, "batch_size": opts.asap_batch_size,
            "trie_growth": asap_run.growth,
            "masker_errors": len(asap_run.masker_errors),
            "masker_error_example": (asap_run.masker_errors or [None])[0],
            "trie_nodes": asap_run.trie.n_nodes, "trie_bytes": asap_run.trie.nbytes(),
            "trie_bytes_per_token": asap_run.trie.nbytes() / max(1, asap_run.trie.n_tokens),
            "trie_bytes_per_sample": asap_run.trie.nbytes() / max(1, asap_run.trie.n_samples),
            "training_seconds": asap_run.seconds,
            "training_seconds_per_sample": asap_run.seconds_per_sample,
            "training_phases": asap_timer.summary(),
        }
    if MASKING not in methods:
        result["methods"].pop(MASKING, None)
    if "rejection" in methods:
        n_valid = int(draws.valid.sum())
        result["methods"]["rejection"] = {
            "kl": ({"kl": 0.0, "ci_low": 0.0, "ci_high": 0.0,
                    "support_size": result["support"]["size"], "n_draws": draws.n,
                    "n_bootstrap": 0} if n_valid else None),
            "note": ("samples the target exactly (KL 0 by construction)" if n_valid else
                     f"no valid draw in {draws.n}: rejection produced no sample, not measurable"),
            "valid_draws": n_valid,
            "forward_tokens_per_valid_sample": (draws.forward_tokens / n_valid if n_valid
                                                else float("inf")),
            "batched_seconds_per_accepted": draws.seconds_per_accepted,
            "acceptance_rate": float(draws.valid.mean()),
        }
    for name, info in shim_info.items():
        result["methods"].setdefault(name, {}).update(info)

    # 4b. fidelity at any P(L): importance sampling from the methods' own proposals
    if opts.mixture_samples > 0:
        result["importance"] = _mixture_fidelity(pre, masker, adjusters, draws, opts, max_new,
                                                 progress)

    # 5. exact KL over a small finite language
    if case.exact:
        result["exact"] = _exact(pre, masker, adjusters, methods, opts)

    # 6. timing: a few samples one at a time per method, through one instrumented loop
    result["timing"] = _time_methods(pre, masker, adjusters, methods, opts, max_new, asap_run,
                                     compile_timer)
    for name, t in result["timing"].items():
        if name in result["methods"]:
            result["methods"][name]["seconds_per_sample"] = t["seconds_per_sample"]
    result["seconds"] = time.perf_counter() - t_case
    result["peak_rss_mib"] = peak_rss_mib()
    _log(progress, "  " + ", ".join(
        f"{m}: KL {result['methods'][m]['kl']['kl']:.4f}" for m in result["methods"]
        if result["methods"][m].get("kl")))
    return result


def _fit_shim(case, lm, prepared: PreparedPrompt, masker: Masker, kinds: list[str],
              opts: EvalOptions, max_new: int, progress: bool, info: dict,
              out_dir: Path | None) -> dict[str, Any]:
    """Fit every SHIM kind by ``shim fit``'s recipe (:meth:`EvalOptions.fit_recipe`) on one
    shared first draw (the draw does not depend on the kind; later rounds are each kind's
    own): each controller is the one ``shim fit --seed <seed + 1>`` gives. ``lm``: the LM
    as loaded (the manifest names it; ``prepared`` holds the view the rollouts use)."""
    base = opts.fit_recipe("LR_FULL", max_new, prepared.stop_at_newline)
    rollouts = InProcessRollouts(prepared.lm, masker, prepared.prefilled,
                                 max_new_tokens=max_new, batch_size=base.batch_size,
                                 progress=False)
    t0 = time.perf_counter()
    first = draw_first(rollouts, base)
    sample_seconds = time.perf_counter() - t0
    _log(progress, f"  training data ({first.target} target: "
                   f"{first.target_record['target_reason']}): {first.data.n_completions} "
                   f"completions in {sample_seconds:.1f}s, valid fraction "
                   f"{float(np.mean(first.data.valid)):.3f}")
    out = {}
    for name in kinds:
        t0 = time.perf_counter()
        directory = (out_dir / "controllers" / case.name / name) if out_dir else \
            Path(tempfile.mkdtemp(prefix="shim-eval-"))
        recipe = replace(base, kind=SHIM_KINDS[name])
        try:
            controller, manifest = fit_with_recipe(lm, masker, recipe, case.prompt,
                                                   prepared=prepared, first=first,
                                                   output_dir=directory)
        except ValueError as exc:  # e.g. no training rows for the final target
            info[name] = {"error": str(exc), "target": first.target,
                          "falls_back_to_masking": True}
            out[name] = None
            _log(progress, f"  {name}: not fitted ({exc}); scored as masking")
            continue
        fit_seconds = time.perf_counter() - t0
        training = manifest["training"]
        info[name] = {"fit_seconds": fit_seconds,
                      "training_samples": training.get("lm_samples_total", base.n_samples),
                      "training_sample_seconds": sample_seconds, "target": first.target,
                      "target_reason": first.target_record.get("target_reason"),
                      "p_valid_estimate": training.get("p_valid_estimate"),
                      "controller_bytes": int(manifest.get("weights_bytes", 0)),
                      "beta": float(getattr(controller, "beta_", float("nan"))),
                      "reg": float(getattr(controller, "reg_", float("nan"))),
                      "reg_on_grid_edge": bool(getattr(controller, "reg_on_grid_edge_", False)),
                      "falls_back_to_masking": bool(controller.falls_back_to_masking_),
                      "heldout_kl_gain": float(controller.heldout_kl_gain_),
                      "heldout_kl_gain_se": float(controller.heldout_kl_gain_se_),
                      "heldout_effective_samples": float(controller.heldout_effective_samples_),
                      "rounds": training.get("rounds"),
                      "max_train": training.get("max_samples"),
                      "lm_samples_total": training.get("lm_samples_total"),
                      "fallback_reason": getattr(controller, "fallback_reason_", None),
                      "forward_tokens": training.get("data_forward_tokens"),
                      "forward_tokens_per_valid_sample":
                          training.get("forward_tokens_per_valid_sample"),
                      "decision": controller.decision_}
        out[name] = ShimAdjuster(controller)
        _log(progress, f"  {name}: fitted in {fit_seconds:.1f}s (beta={info[name]['beta']}; "
                       f"{controller.decision_})")
    return out


def _mixture_fidelity(pre, masker, adjusters: dict[str, Any], draws, opts: EvalOptions,
                      max_new: int, progress: bool) -> dict[str, Any]:
    """Every masked method draws ``opts.mixture_samples``; the pooled draws (with the
    unconstrained ones) estimate each method's KL to p(·|G) by importance sampling."""
    acceptor = reference_acceptor(masker.grammar)
    eos = eos_ids(pre.lm, masker)
    names = ["lm"] + [m for m in adjusters if m == MASKING or _is_shim(m) or
                      m == f"asap@{opts.asap_samples}"]
    seq_ids: dict[tuple[int, ...], int] = {}
    proposal, sequence = [], []
    cost: dict[str, dict] = {}

    def add(k: int, toks: list[int], ok: bool) -> None:
        proposal.append(k)
        sequence.append(seq_ids.setdefault(tuple(toks), len(seq_ids)) if ok else -1)

    for toks, ok in zip(draws.token_ids, draws.valid):
        add(0, toks, bool(ok))
    gen = torch.Generator().manual_seed(opts.seed + 5)
    for k, name in enumerate(names[1:], start=1):
        if name != MASKING and adjusters.get(name) is None:
            continue  # a SHIM kind that was not fitted
        got = sample(pre, opts.mixture_samples, masker=masker, adjuster=adjusters.get(name),
                     max_new_tokens=max_new, batch_size=opts.batch_size, generator=gen)
        n_valid = 0
        for toks, fin in zip(got.token_ids, got.finished):
            text = masker.decode([t for t in toks if t not in eos])
            ok = bool(fin) and acceptor.accepts(text)
            n_valid += ok
            add(k, toks, ok)
        cost[name] = {"seconds_per_sample": got.seconds / max(got.n, 1),
                      "forward_tokens_per_sample": got.forward_tokens / max(got.n, 1),
                      "valid_fraction": n_valid / max(got.n, 1), "samples": got.n}
    sequences = [list(t) for t in seq_ids]
    t0 = time.perf_counter()
    scored = score_sequences(pre, sequences, masker,
                             {m: adjusters.get(m) for m in names[1:]})
    score_seconds = time.perf_counter() - t0
    mix = MixtureDraws(np.array(proposal), np.array(sequence), names)
    pairs = [(m.removesuffix(OWN_FIT), m) for m in names
             if m.endswith(OWN_FIT) and m.removesuffix(OWN_FIT) in names]
    est = mixture_kl(mix, scored.lm, scored.methods, n_bootstrap=opts.n_bootstrap,
                     seed=opts.seed, pairs=pairs)
    out = est.as_dict()
    out["cost"] = cost
    out["scoring_seconds"] = score_seconds
    out["distinct_sequences"] = len(sequences)
    if "lr_full" in cost and "lr_full" in est.own_ess:  # exact-target mode (SIR over SHIM)
        own = est.own_ess["lr_full"]
        seconds = cost["lr_full"]["seconds_per_sample"] * cost["lr_full"]["samples"] + \
            score_seconds * cost["lr_full"]["samples"] / max(len(proposal), 1)
        out["exact_target"] = {"proposal": "lr_full", "ess": own,
                               "seconds_per_effective_sample": seconds / own if own else
                               float("inf"),
                               "forward_tokens_per_effective_sample":
                                   cost["lr_full"]["forward_tokens_per_sample"] *
                                   cost["lr_full"]["samples"] / own if own else float("inf")}
    _log(progress, f"  importance: ESS {est.ess:.1f} of {len(proposal)} draws, P(L) "
                   f"{est.p_valid:.3g}; " + ", ".join(
                       f"{m}: {v:.3f}" for m, v in est.kl.items()))
    return out


def _exact(pre, masker, adjusters, methods, opts) -> dict[str, Any]:
    chosen = {k: v for k, v in adjusters.items()
              if not k.startswith("asap@") or k == f"asap@{opts.asap_samples}"}
    try:
        lang = enumerate_language(pre, masker, chosen)
    except LanguageTooLargeError as exc:
        return {"error": str(exc)}
    target = lang.target()
    out: dict[str, Any] = {"n_sequences": len(lang.sequences),
                           "target_by_string": grouped_probabilities(lang.texts, target),
                           "kl": {}, "by_string": {}, "total_mass": {}}
    for name, lp in lang.methods.items():
        label = "asap" if name.startswith("asap@") else name
        if label not in methods:
            continue
        out["kl"][label] = exact_kl(target, lp)
        out["by_string"][label] = grouped_probabilities(lang.texts, lp)
        out["total_mass"][label] = float(np.exp(np.logaddexp.reduce(lp)))
    return out


def _time_methods(pre, masker, adjusters, methods, opts, max_new, asap_run,
                  compile_timer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    k = opts.timing_samples
    if k <= 0:
        return out
    gen = torch.Generator().manual_seed(opts.seed + 3)
    for name in methods:
        timer = PhaseTimer()
        timer.merge(compile_timer)
        t0 = time.perf_counter()
        accepted = k
        tokens = 0
        if name == "rejection":
            draws = [sample(pre, 1, max_new_tokens=max_new, generator=gen, timer=timer)
                     for _ in range(k)]

            acceptor = reference_acceptor(masker.grammar)
            accepted = sum(1 for d in draws if d.finished[0] and acceptor.accepts(
                masker.decode([t for t in d.token_ids[0] if t not in masker.eos_token_ids
                               and t not in pre.lm.eos_token_ids])))
            tokens = sum(len(d.token_ids[0]) for d in draws)
        elif name == "asap":
            # ASAp keeps learning while it samples: its per-sample cost includes the update
            trie = asap_run.trie.snapshot()
            run = run_asap(pre, masker, k, batch_size=1, max_new_tokens=max_new, generator=gen,
                           timer=timer, trie=trie)
            tokens = sum(len(s) for s in run.samples)
        else:
            adjuster = adjusters.get(name)
            for _ in range(k):
                d = sample(pre, 1, masker=masker, adjuster=adjuster, max_new_tokens=max_new,
                           generator=gen, timer=timer)
                tokens += len(d.token_ids[0])
        seconds = time.perf_counter() - t0
        out[name] = {"samples": k, "accepted": accepted, "seconds": seconds,
                     "tokens_per_sample": tokens / k,
                     "seconds_per_sample": seconds / accepted if accepted else float("inf"),
                     "phases": timer.summary()}
    return out
