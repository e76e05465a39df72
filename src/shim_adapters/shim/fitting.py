"""``fit_controller``: from an LM, a masker and a prompt to a fitted, checked SHIM controller.

The recipe depends on the regime, and the regime is measured, not guessed:

1. The prompt is rendered (``chat=True``: the LM's chat template) and prefilled once.
2. Where the answer ends: :func:`~shim_adapters.lm.prompting.detect_line_answers` probes a few
   masked completions; one-line answers to few-shot prompts end at a newline (folded into EOS
   for every method alike). Recorded with its numbers.
3. The target (``target="auto"``): soft labels from masked rollouts, measured at least as
   good as the paper's final-validity labels where valid unconstrained draws are plentiful
   and far better where they are rare (see :func:`choose_target`). P(L), the LM's chance of
   producing a valid string unconstrained, is estimated from the rollouts (mean ∏ Z) and
   recorded with the reason.
4. Rounds (``rounds=K``, rollout target): the budget of ``n_samples`` LM samples is split over
   K rounds. Round 1 draws masked rollouts; each later round draws from the current controller
   (a defensive per-step mixture with masking by default), pools the rows of all rounds (every
   row keeps the importance ratio of its own proposal) and refits. A round is kept only when
   the refit beats the current controller on that round's fresh completions (importance-
   weighted held-out log-likelihood, > ``min_gain_se`` standard errors); else the current one
   stays. The never-worse-than-masking fallback of each fit is unchanged. Measured on the
   shipped LM (``reports/fast-rounds-*``, 600 samples): 3 rounds of 200 did not beat one round
   of 600 masked rollouts (bv4 −0.19 vs −0.22, json −0.10 vs −0.12, sql −0.03 vs −0.04 nats
   against masking), as on SmolLM2 (``reports/smollm2-matrix``): the default is one round.
5. Top-ups (rollout target): a fit that is not trusted *only* because its held-out target ESS
   is below ``min_target_samples`` (where the LM is rarely valid, a few masked rollouts carry
   almost all the importance weight) says nothing about whether the correction helps. Then
   more LM samples are drawn, up to ``max_samples`` in all, from a defensive mixture of
   masking and that fit at its best held-out β (:meth:`Controller.untrusted_candidate`),
   pooled and refitted, until the usual criterion decides (trusted, or no gain) or the cap is
   spent; each top-up is a ``training.rounds`` entry (reason, ESS before/after, LM samples,
   forward tokens). A pool drawn from several proposals weights its completions as target
   samples by the balance heuristic, each scored under every proposal of the pool: the
   own-proposal ratio is exactly unbiased too, but keeps the few huge masked weights that made
   the evidence thin (both ESS are recorded). As the later proposals were fitted on the earlier
   draws, this is adaptive multiple importance sampling: consistent, not exactly unbiased.
   The fallback to masking is unchanged: an untrusted fit still serves β = 0.
   Top-ups stop early when they stall: after a top-up, the held-out ESS it gained per LM
   sample, carried over the samples left under the cap and doubled (``topup_stall_margin``),
   must still reach what is sought (the floor, or the band's top when inside the band). Where
   the LM is hopelessly rarely valid (SLIA ``name-combine-2-long-repeat``: ESS 1.98 -> 1.90
   over a 300-sample top-up) this saves the rest of the cap; applied to every top-up recorded
   in ``reports/`` it changes no decision (``benchmarks/topup_stall_replay.py``,
   ``reports/topup-stall``). The first top-up is always drawn: its proposal is
   the fit, not masking, and moved the ESS 2.1 -> 64 on BV4 ``find_inv_bvugt_bvurem1``.
Costs are counted as CARS does: LM positions evaluated (``forward_tokens``) per valid sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol

import numpy as np

from shim_adapters.lm.prompting import detect_line_answers, render_prompt
from shim_adapters.lm.sampling import PrefilledPrompt, prefill
from shim_adapters.lm.views import stop_folded
from shim_adapters.mask.protocol import Masker
from shim_adapters.shim.artefact import build_manifest, save_controller
from shim_adapters.shim.controller import make_controller
from shim_adapters.shim.prompt_set import FittedPrompts, PromptSet, prompt_ids_sha256
from shim_adapters.shim.targets import (
    completion_log_ratio,
    effective_sample_size,
    make_targets,
    masked_row_logprob,
    mixture_target_weights,
    shim_row_logprob,
    target_weights,
)
from shim_adapters.shim.training_data import (
    TrainingData,
    concat_training_data,
    sample_training_data,
)

log = logging.getLogger(__name__)

#: Every target ``fit_controller`` accepts.
FIT_TARGETS = ("auto", "final", "rollout", "bootstrap")
#: Proposals for the rounds after the first.
ROUND_PROPOSALS = ("shim", "defensive")
#: The cap on LM samples per problem: top-ups stop here.
DEFAULT_MAX_SAMPLES = 1000
#: ``FitRecipe.evidence_band`` of the ``shim fit`` / ``shim eval`` commands.
CLI_EVIDENCE_BAND = 2.0
#: ``FitRecipe.text_features``: token ids only, with text features, or the better of the two
#: on held-out completions.
TEXT_FEATURE_CHOICES = ("off", "on", "auto")
#: Longest byte n-gram of the text features (:mod:`shim_adapters.shim.features`).
TEXT_NGRAMS = 3


def _p_valid_estimate(log_ratio_totals: np.ndarray, valid: np.ndarray) -> float:
    """Mean of 1[x in L]·p(x)/q(x): an unbiased estimate of P(L) from any proposal."""
    w = np.where(valid, np.exp(np.minimum(log_ratio_totals, 50.0)), 0.0)
    return float(w.mean()) if len(w) else float("nan")


def choose_target() -> tuple[str, dict[str, Any]]:
    """``target="auto"``: soft rollout labels in every regime measured so far.

    The evidence (``reports/fast-targets-*``, shipped LM, N = 1,000, language KL of LR_FULL):
    where valid draws are plentiful (P(L) 0.5-0.67) rollout labels match the paper's final
    labels (binary5 0.044 vs 0.044, bv4 0.058 vs 0.060, json 0.080 vs 0.094, sql 0.075 vs
    0.081 nats); where they are rare (SmolLM2, P(L) 0.5-9%) final labels fall back to masking
    and rollout labels cut the KL several-fold (``reports/smollm2-matrix``). So no probe is
    spent on the choice; P(L) is estimated afterwards from the rollouts themselves (mean of
    ∏ Z, unbiased) and recorded. ``target="final"`` stays available."""
    return "rollout", {"target_reason": (
        "auto: rollout labels (every row of a masked rollout labelled by ∏ Z of its suffix); "
        "measured at least as good as final-validity labels where valid draws are plentiful "
        "and far better where they are rare (reports/fast-targets-*, reports/smollm2-matrix)")}


@dataclass(frozen=True)
class FitRecipe:
    """How a controller is fitted: every knob of the recipe, checked once.

    ``shim fit``, ``shim eval`` and :func:`fit_controller` all build one of these, so the three
    paths run the same recipe with the same defaults. ``target``: ``"auto"`` (module docstring),
    ``"final"``, ``"rollout"`` or ``"bootstrap"`` (:mod:`shim_adapters.shim.targets`).
    ``rounds``: iterated refits within the same total budget of ``n_samples`` LM samples
    (rollout target only). ``max_samples``: the cap on LM samples for top-ups (module
    docstring, item 5); a first draw of ``n_samples`` or more leaves none; None: no top-ups.
    ``chat``: apply the tokenizer's chat template to the prompt. ``stop_at_newline``:
    ``"auto"`` (probe), True or False. ``controller_params`` go to the controller's
    constructor."""

    kind: str = "LR_FULL"
    n_samples: int = 1000
    max_new_tokens: int = 128
    seed: int = 0
    target: str = "auto"
    rounds: int = 1
    round_proposal: str = "defensive"
    defensive: float = 0.5
    max_samples: int | None = DEFAULT_MAX_SAMPLES
    chat: bool = False
    stop_at_newline: bool | str = "auto"
    bootstrap_rounds: int = 1
    batch_size: int = 64
    progress: bool = True
    #: A held-out target ESS below ``evidence_band`` x the controller's floor
    #: (``min_target_samples``) is too close to the floor to decide on: the fit draws more
    #: evidence first (top-ups, within ``max_samples``) instead of deciding from it. 1.0 decides
    #: at the floor (the library default: small test and demo fits keep their budget); the
    #: ``shim`` commands default to :data:`CLI_EVIDENCE_BAND`, where the decision is measured
    #: to flip less with the seed (``reports/trust-band``).
    evidence_band: float = 1.0
    #: Features that see the token's text (hashed byte n-grams, crossed with the state):
    #: ``"off"``, ``"on"`` or ``"auto"`` (fit both on the first draw, keep the one with the
    #: better held-out score; recorded in ``training.features``).
    text_features: str = "off"
    #: Top-ups stop once one has stalled (module docstring, item 5): the held-out ESS it gained
    #: per LM sample, over the samples left under the cap and times this margin, would not
    #: reach what is sought. None: top up until the criterion decides or the cap is spent.
    topup_stall_margin: float | None = 2.0
    controller_params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target not in FIT_TARGETS:
            raise ValueError(f"unknown target {self.target!r}; choose one of "
                             f"{', '.join(FIT_TARGETS)}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.round_proposal not in ROUND_PROPOSALS:
            raise ValueError(f"round_proposal must be one of {', '.join(ROUND_PROPOSALS)}")
        if self.rounds > 1 and self.target in ("final", "bootstrap"):
            raise ValueError(f"rounds > 1 refits on the controller's own rollouts; the "
                             f"{self.target!r} target cannot use them (use target='rollout' or "
                             f"'auto')")
        if self.n_samples < self.rounds * 2:
            raise ValueError(f"n_samples={self.n_samples} is too small for {self.rounds} "
                             f"round(s)")
        if self.text_features not in TEXT_FEATURE_CHOICES:
            raise ValueError(f"text_features must be one of {', '.join(TEXT_FEATURE_CHOICES)}, "
                             f"got {self.text_features!r}")
        if not self.evidence_band >= 1.0:
            raise ValueError(f"evidence_band must be >= 1 (1: decide at the floor), got "
                             f"{self.evidence_band}")
        if self.topup_stall_margin is not None and not self.topup_stall_margin > 0:
            raise ValueError(f"topup_stall_margin must be > 0 (or None: never stop early), "
                             f"got {self.topup_stall_margin}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1 (or None: no top-ups), got "
                             f"{self.max_samples}")

    def new_controller(self, text_ngrams: int | None = None):
        """A fresh controller of the recipe (``text_ngrams``: the text-feature choice made)."""
        params = dict(self.controller_params)
        if text_ngrams is None:
            text_ngrams = TEXT_NGRAMS if self.text_features == "on" else 0
        if text_ngrams:
            params.setdefault("text_ngrams", text_ngrams)
        return make_controller(self.kind, **params)

    def round_sizes(self) -> list[int]:
        """LM samples per planned round: ``n_samples`` split evenly, the rest in round 1."""
        sizes = [self.n_samples // self.rounds] * self.rounds
        sizes[0] += self.n_samples - sum(sizes)
        return sizes


class Rollouts(Protocol):
    """Where a fit's completions come from: ``draw`` returns replayed
    :class:`~shim_adapters.shim.training_data.TrainingData` for ``n`` completions from the
    proposal ``"lm"``, ``"masked"`` or ``"shim"`` (``controller``, mixed with masking by
    ``defensive``). ``draws_controllers`` False: the source samples masking only (an engine
    whose processor runs in masking mode), so every later round and top-up draws masked
    rollouts: more evidence from the same proposal, never a controller's."""

    draws_controllers: bool

    def draw(self, n: int, proposal: str, seed: int, controller=None,
             defensive: float = 0.0) -> TrainingData: ...


@dataclass
class InProcessRollouts:
    """Completions drawn by this process's sampling engine on a prefilled prompt."""

    lm: Any
    masker: Masker
    prefilled: PrefilledPrompt
    max_new_tokens: int = 128
    batch_size: int = 64
    progress: bool = True
    draws_controllers = True

    def draw(self, n: int, proposal: str, seed: int, controller=None,
             defensive: float = 0.0) -> TrainingData:
        data = sample_training_data(self.lm, self.masker, self.prefilled.prompt, n,
                                    max_new_tokens=self.max_new_tokens, seed=seed,
                                    progress=self.progress, proposal=proposal,
                                    controller=controller, prefilled=self.prefilled,
                                    batch_size=self.batch_size, defensive=defensive)
        return with_token_texts(data, self.masker)


def with_token_texts(data: TrainingData, masker: Masker) -> TrainingData:
    """Record the text of every token the rows hold (``manifest["token_texts"]``): text
    features need it, and the masker that decodes it is not at hand when the controller fits."""
    tokens = np.unique(data.row_token).tolist()
    data.manifest = dict(data.manifest, token_texts={
        int(t): masker.decode([int(t)]) for t in tokens})
    return data


def _pooled_texts(parts) -> dict[int, str] | None:
    texts: dict[int, str] = {}
    for p in parts:
        got = p.data.manifest.get("token_texts")
        if got is None:
            return None
        texts.update({int(k): v for k, v in got.items()})
    return texts


#: Seed stride between the prompts of a set (rounds step by 1000: no two draws share a seed).
PROMPT_SEED_STRIDE = 100_003


@dataclass
class PromptSetRollouts:
    """Completions of several prompts of one grammar: each draw of ``n`` is spread evenly over
    the prompts (the first ``n mod k`` prompts draw one more), each prompt on its own seed.
    Rows of different prompts are different states of the same grammar, so they pool; each
    completion keeps its own proposal's importance ratio under its own prompt. The draw's
    ``manifest["completion_prompt"]`` says which prompt each completion answers (the
    held-out criterion holds out whole prompts)."""

    sources: list

    @property
    def draws_controllers(self) -> bool:
        return all(getattr(s, "draws_controllers", True) for s in self.sources)

    def draw(self, n: int, proposal: str, seed: int, controller=None,
             defensive: float = 0.0) -> TrainingData:
        k = len(self.sources)
        counts = [n // k + (1 if i < n % k else 0) for i in range(k)]
        parts, owners = [], []
        for i, (source, m) in enumerate(zip(self.sources, counts)):
            if m:
                parts.append(source.draw(m, proposal, seed + PROMPT_SEED_STRIDE * i,
                                         controller, defensive))
                owners.append(np.full(m, i, dtype=np.int64))
        data = concat_training_data(parts)
        texts = {}
        for part in parts:
            texts.update(part.manifest.get("token_texts") or {})
        data.manifest = dict(data.manifest, completion_prompt=np.concatenate(owners).tolist(),
                             prompt_counts=counts, token_texts=texts)
        return data


def _completion_prompts(parts) -> np.ndarray | None:
    """Per pooled completion: the prompt it answers (None: one prompt)."""
    owners = [p.data.manifest.get("completion_prompt") for p in parts]
    if any(o is None for o in owners):
        return None
    return np.concatenate([np.asarray(o, dtype=np.int64) for o in owners])


def fit_controller(lm, masker, prompt: str | None = None, kind: str = "LR_FULL",
                   n_samples: int = 1000, *, output_dir=None, data=None,
                   max_new_tokens: int = 128, seed: int = 0, progress: bool = True,
                   target: str = "auto", rounds: int = 1, round_proposal: str = "defensive",
                   defensive: float = 0.5, max_samples: int | None = DEFAULT_MAX_SAMPLES,
                   chat: bool = False,
                   stop_at_newline: bool | str = "auto", bootstrap_rounds: int = 1,
                   batch_size: int = 64, prefilled=None, **controller_params
                   ) -> tuple[Any, dict[str, Any]]:
    """Sample training data (unless ``data`` is given), fit a controller, build its manifest.

    ``lm`` is a :class:`shim_adapters.lm.loading.LoadedLM`; ``prompt`` defaults to the grammar's
    built-in prompt. The keyword arguments are those of :class:`FitRecipe`. ``data`` (round 1's
    completions) and ``prefilled`` (the prompt's prefill, on the LM view to use) let a caller
    share one draw between controllers. With ``output_dir`` the artefact is also written there
    (and the returned manifest is the one on disk, checksums included). When the correction
    does not beat masking on held-out completions the controller falls back to β = 0 and says
    so (a warning, ``controller.decision_`` and the manifest's ``training.decision``).
    """
    recipe = FitRecipe(kind=kind, n_samples=n_samples, max_new_tokens=max_new_tokens,
                       seed=seed, target=target, rounds=rounds, round_proposal=round_proposal,
                       defensive=defensive, max_samples=max_samples, chat=chat,
                       stop_at_newline=stop_at_newline, bootstrap_rounds=bootstrap_rounds,
                       batch_size=batch_size, progress=progress,
                       controller_params=controller_params)
    return fit_with_recipe(lm, masker, recipe, prompt, output_dir=output_dir, data=data,
                           prefilled=prefilled)


def fit_with_recipe(lm, masker, recipe: FitRecipe, prompt: str | PromptSet | None = None, *,
                    output_dir=None, data=None, prefilled=None,
                    prepared: PreparedPrompt | None = None, first: FirstDraw | None = None
                    ) -> tuple[Any, dict[str, Any]]:
    """:func:`fit_controller` with the recipe as one value: prompt -> rollouts -> fit.

    ``prompt`` may be a :class:`~shim_adapters.shim.prompt_set.PromptSet`: the budget is spread
    over its prompts (:class:`PromptSetRollouts`), the rows pooled, and the held-out criterion
    holds out whole prompts. ``prepared`` (from :func:`prepare_prompt`) and ``first`` (from
    :func:`draw_first`) let a caller share the prompt's preparation and the first draw between
    controllers of one recipe (``shim eval`` fits several kinds): the result is the one a fit
    without them gives, record included."""
    if isinstance(prompt, PromptSet) and len(prompt) > 1:
        if data is not None or prefilled is not None or prepared is not None:
            raise ValueError("a fit over a prompt set draws its own data: data, prefilled and "
                             "prepared are for one prompt")
        return _fit_prompt_set(lm, masker, recipe, prompt, output_dir=output_dir, first=first)
    if isinstance(prompt, PromptSet):
        prompt = prompt.prompts[0]
    prompt = _resolve_prompt(masker, prompt)
    if prepared is None:
        prepared = _prepare_given(lm, masker, prompt, recipe, data, prefilled)
    rollouts = InProcessRollouts(prepared.lm, masker, prepared.prefilled,
                                 max_new_tokens=recipe.max_new_tokens,
                                 batch_size=recipe.batch_size, progress=recipe.progress)
    training: dict[str, Any] = {"prompting": dict(prepared.record)}
    controller = run_recipe(rollouts, recipe, training, data=data, first=first)
    return _write(controller, masker, lm, prompt, training, output_dir)


def _fit_prompt_set(lm, masker, recipe: FitRecipe, prompts: PromptSet, *, output_dir,
                    first: FirstDraw | None) -> tuple[Any, dict[str, Any]]:
    """Where answers end is probed on the first prompt and holds for the whole set (one LM
    view for every prompt, as one deployment of the grammar has)."""
    head = prepare_prompt(lm, masker, prompts.prompts[0], recipe)
    fixed = replace(recipe, stop_at_newline=bool(head.record["stop_at_newline"]))
    prepared = [head] + [prepare_prompt(lm, masker, p, fixed) for p in prompts.prompts[1:]]
    rollouts = PromptSetRollouts([
        InProcessRollouts(p.lm, masker, p.prefilled, max_new_tokens=recipe.max_new_tokens,
                          batch_size=recipe.batch_size, progress=recipe.progress)
        for p in prepared])
    record = dict(head.record, probed_on="the set's first prompt",
                  prompt_ids_sha256=[h for p in prepared for h in p.record["prompt_ids_sha256"]])
    training: dict[str, Any] = {"prompting": record, "prompt_set": prompts.record()}
    controller = run_recipe(rollouts, recipe, training, first=first)
    return _write(controller, masker, lm, prompts.prompts[0], training, output_dir)


@dataclass
class FirstDraw:
    """The first draw of a recipe and the target it was drawn for."""

    target: str
    target_record: dict[str, Any]  #: ``target_reason`` (and the like) for the manifest
    data: TrainingData


def draw_first(rollouts: Rollouts, recipe: FitRecipe) -> FirstDraw:
    """Round 1's completions: unconstrained for the final-validity target, masked otherwise.
    The draw does not depend on the controller's kind, so kinds may share it."""
    if recipe.target == "auto":
        chosen, record = choose_target()
    else:
        chosen, record = recipe.target, {"target_reason": "asked for"}
    data = rollouts.draw(recipe.round_sizes()[0], "lm" if chosen == "final" else "masked",
                         recipe.seed)
    return FirstDraw(chosen, record, data)


def run_recipe(rollouts: Rollouts, recipe: FitRecipe, training: dict[str, Any], *,
               data: TrainingData | None = None, first: FirstDraw | None = None):
    """The fit itself, from any source of rollouts: choose the target, fit on the first draw,
    then the planned rounds and the thin-evidence top-ups. Fills ``training`` (the manifest's
    training record) and returns the controller. ``data``: a caller's own round-1 data (the
    target follows how it was drawn); ``first``: a :func:`draw_first` of this recipe."""
    sizes = recipe.round_sizes()
    if data is not None:
        chosen = _target_of_given(recipe, data, training)
        if recipe.rounds > 1 and data.n_completions != sizes[0]:
            sizes[0] = data.n_completions
    else:
        first = first if first is not None else draw_first(rollouts, recipe)
        chosen, data = first.target, first.data
        training.update(first.target_record)
        training["target"] = chosen
    training["p_valid_estimate"] = _p_valid_estimate(completion_log_ratio(data), data.valid)
    fit = _first_fit(recipe, chosen, data)
    _refit_rounds(fit, recipe, rollouts, sizes)
    _record_training(training, fit, recipe)
    return fit.controller


def _resolve_prompt(masker, prompt: str | None) -> str:
    if prompt is None:
        prompt = masker.grammar.default_prompt
        if prompt is None:
            raise ValueError(f"grammar {masker.grammar.name!r} has no default prompt: give a "
                             f"prompt")
    return prompt


@dataclass
class PreparedPrompt:
    """The prompt as the rollouts see it."""

    lm: Any  #: the LM view the rollouts use (stop-folded when answers end at a newline)
    prefilled: PrefilledPrompt
    record: dict[str, Any]  #: the manifest's ``training.prompting``

    @property
    def stop_at_newline(self) -> bool:
        return bool(self.record["stop_at_newline"])


def prepare_prompt(lm, masker, prompt: str, recipe: FitRecipe) -> PreparedPrompt:
    """Render and prefill the prompt once; probe where answers end (``stop_at_newline="auto"``:
    one-line answers to few-shot prompts end at a newline, folded into EOS for every method
    alike). An evaluation prepares its case's prompt with the fit's recipe, so every method
    sees the LM view the controller was fitted on."""
    record: dict[str, Any] = {"chat": bool(recipe.chat)}
    rendered = render_prompt(lm.tokenizer, prompt, recipe.chat)
    pre = prefill(lm, rendered.text, add_special_tokens=rendered.add_special_tokens)
    if recipe.stop_at_newline == "auto":
        probe = detect_line_answers(pre, masker, max_new_tokens=recipe.max_new_tokens,
                                    seed=recipe.seed)
        fold = probe.fold
        record["line_answer_probe"] = probe.as_dict()
        if fold:
            log.warning("answers end at a newline: %s", probe.reason)
    else:
        fold = bool(recipe.stop_at_newline)
    record["stop_at_newline"] = fold
    if fold:
        lm = stop_folded(lm, masker.eos_token_ids)
        pre = prefill(lm, pre.prompt, add_special_tokens=rendered.add_special_tokens)
    # what a LogitsProcessor sees of its prompt: the wrappers compare it with the fit's
    record["prompt_ids_sha256"] = [prompt_ids_sha256(pre.ids[0].tolist())]
    return PreparedPrompt(lm, pre, record)


def _prepare_given(lm, masker, prompt: str, recipe: FitRecipe, data, prefilled
                   ) -> PreparedPrompt:
    """A caller's prefill or data already fixed the LM view: no probe."""
    record: dict[str, Any] = {"chat": bool(recipe.chat),
                              "stop_at_newline": bool(recipe.stop_at_newline is True)}
    if prefilled is None and data is None:
        return prepare_prompt(lm, masker, prompt, recipe)
    if prefilled is None:
        rendered = render_prompt(lm.tokenizer, prompt, recipe.chat)
        prefilled = prefill(lm, rendered.text, add_special_tokens=rendered.add_special_tokens)
    # else the caller rendered (chat) and prefilled the prompt already
    record["prompt_ids_sha256"] = [prompt_ids_sha256(prefilled.ids[0].tolist())]
    return PreparedPrompt(lm, prefilled, record)


def _target_of_given(recipe: FitRecipe, data, training: dict[str, Any]) -> str:
    chosen = recipe.target if recipe.target != "auto" else (
        "final" if data.manifest.get("sampling", {}).get("proposal", "lm") == "lm"
        else "rollout")
    training["target_reason"] = "given data" if recipe.target == "auto" else "asked for"
    training["target"] = chosen
    return chosen


@dataclass
class _Fit:
    """A fit in progress: the current controller and everything drawn so far."""

    chosen: str
    controller: Any
    targets: Any
    #: Every pooled draw with the proposal it came from, so that the pool's target weights can
    #: use the balance heuristic (each completion scored under every proposal).
    parts: list
    history: list[dict]
    spent: int
    pool: Any
    pooled: Any = None
    cap: int = 0
    #: The text-feature choice of the first fit, kept by every refit.
    text_ngrams: int = 0


def _first_fit(recipe: FitRecipe, chosen: str, data) -> _Fit:
    targets = make_targets(chosen, data, recipe.new_controller, rounds=recipe.bootstrap_rounds)
    if targets.data.n_rows == 0:
        raise ValueError(
            f"no training rows: all {data.n_completions} unconstrained completions were refused "
            f"by the masker at their first token (valid fraction {np.mean(data.valid):.3g}); "
            f"the final-validity target needs valid draws: use target='rollout' (or 'auto')")
    parts = [_Part(data, None, 0.0)]
    controller, features = _fit_features(recipe, targets, _group_kw(parts, targets.data))
    first = _round_entry(1, data, targets, controller, kept=True)
    first["features"] = features
    first.update(kind="first draw", lm_samples=int(data.n_completions))
    return _Fit(chosen, controller, targets, parts, [first], int(data.n_completions), data,
                text_ngrams=int(getattr(controller, "text_ngrams", 0)))


def _fit_features(recipe: FitRecipe, targets, group_kw: dict) -> tuple[Any, dict[str, Any]]:
    """The first fit; with ``text_features="auto"`` once without and once with text features,
    keeping the better held-out score (the cross-validated log-likelihood of the held-out
    completions at each fit's best regularisation and β, on the same folds and weights)."""
    options = {"off": [0], "on": [TEXT_NGRAMS], "auto": [0, TEXT_NGRAMS]}[recipe.text_features]
    fits = []
    for n in options:
        c = recipe.new_controller(text_ngrams=n).fit(
            targets.data, y=targets.y, completion_weight=targets.completion_weight, **group_kw)
        fits.append((float(np.max(c.cv_scores_)), n, c))
    score, n, controller = max(fits, key=lambda f: f[0])
    record = {"text_ngrams": n, "choice": recipe.text_features,
              "n_features": int(controller.n_features_in_),
              "candidates": [{"text_ngrams": m, "heldout_score": sc,
                              "n_features": int(c.n_features_in_),
                              "fit_seconds": float(c.fit_seconds_)} for sc, m, c in fits]}
    return controller, record

def _group_kw(parts, data) -> dict[str, Any]:
    """Fit keywords: with several prompts, cross-validation holds out whole prompts."""
    owners = _completion_prompts(parts)
    if owners is None or len(owners) != data.n_completions:
        return {}
    return {"completion_group": owners}


def _is_thin(fit: _Fit, recipe: FitRecipe) -> bool:
    """Too little held-out evidence to decide (rollout target): not trusted only for want of
    it, or a held-out ESS inside the band above the floor, where the decision flips with the
    seed."""
    if fit.chosen != "rollout":
        return False
    c = fit.controller
    if getattr(c, "fallback_reason_", None) == "low_target_samples":
        return True
    # only the band above the floor: below it the fit says why (thin: above; none at all:
    # "no_target_samples", where more of the same draws have not helped)
    ess = getattr(c, "heldout_effective_samples_", float("inf"))
    floor = c.min_target_samples
    return bool(floor <= ess < recipe.evidence_band * floor)


def _next_proposal(fit: _Fit, recipe: FitRecipe, thin: bool):
    """Who draws the next round: where the candidate points when evidence is thin, masking
    when the fit fell back, else the controller (defensively mixed with masking)."""
    if thin:
        return fit.controller.untrusted_candidate(), recipe.defensive
    if fit.controller.falls_back_to_masking_:
        return None, 0.0
    return fit.controller, (recipe.defensive if recipe.round_proposal == "defensive" else 0.0)


def _refit_rounds(fit: _Fit, recipe: FitRecipe, rollouts: Rollouts, sizes: list[int]) -> None:
    """Planned rounds, then top-ups while the evidence is thin and the cap allows."""
    topup_size = fit.spent
    fit.cap = max(fit.spent + sum(sizes[1:]), recipe.max_samples or 0)  # never below the plan
    r = 1
    while True:
        r += 1
        regular = r <= recipe.rounds
        thin = _is_thin(fit, recipe)
        if not regular and not (thin and fit.spent < fit.cap):
            if thin:
                log.warning("held-out evidence still thin (ESS %.3g) after %d LM samples: the "
                            "cap of %d is spent; %s", fit.controller.heldout_effective_samples_,
                            fit.spent, fit.cap, fit.controller.decision_)
            return
        n_draw = sizes[r - 1] if regular else min(topup_size, fit.cap - fit.spent)
        proposer, mix = _next_proposal(fit, recipe, thin)
        if proposer is not None and not getattr(rollouts, "draws_controllers", True):
            proposer, mix = None, 0.0  # a masking-only source: more masked evidence
        fresh = rollouts.draw(n_draw, "masked" if proposer is None else "shim",
                              recipe.seed + 1000 * r, proposer, mix)
        fit.spent += n_draw
        fit.parts.append(_Part(fresh, proposer, mix))
        fit.pool = concat_training_data([p.data for p in fit.parts])
        texts = _pooled_texts(fit.parts)
        if texts is not None:
            fit.pool.manifest = dict(fit.pool.manifest, token_texts=texts)
        fit.pooled = _pooled_targets(fit.pool, fit.parts)
        candidate = recipe.new_controller(text_ngrams=fit.text_ngrams).fit(
            fit.pooled.data, y=fit.pooled.y, completion_weight=fit.pooled.completion_weight,
            **_group_kw(fit.parts, fit.pooled.data))
        if regular and not thin:
            keep, entry = _judge_round(r, fit, fresh, candidate)
        else:
            # the current fit fell back for want of evidence, so nothing trusted is replaced:
            # the refit on the larger pool decides by the usual criterion (and may fall back)
            keep, entry = True, _topup_entry(r, fit, fresh, candidate, proposer, mix, regular,
                                             recipe)
        entry["lm_samples"] = int(n_draw)
        entry.setdefault("kind", "round")
        fit.history.append(entry)
        if keep:
            fit.controller, fit.targets = candidate, fit.pooled
        if not regular and _is_thin(fit, recipe) and fit.spent < fit.cap:
            stall = topup_stalled(entry, fit.controller.min_target_samples, recipe, fit.cap)
            if stall is not None:
                entry["stalled"] = stall
                log.warning("top-ups stopped: %s; %s", stall, fit.controller.decision_)
                return


def topup_stalled(entry: Mapping[str, Any], floor: float, recipe: FitRecipe,
                  cap: int) -> str | None:
    """Why more top-ups are not worth drawing after the top-up ``entry`` (a ``training.rounds``
    record), or None. The ESS sought is the floor, or ``evidence_band`` x the floor once the
    floor is reached; the ESS the top-up gained per LM sample, carried over the ``cap``'s
    remaining samples and times ``recipe.topup_stall_margin``, must reach it."""
    if recipe.topup_stall_margin is None:
        return None
    before, after = entry["heldout_ess_before"], entry["heldout_ess_after"]
    spent, drawn = entry["lm_samples_total"], entry["lm_samples"]
    sought = floor if after < floor else recipe.evidence_band * floor
    rate = max(after - before, 0.0) / max(drawn, 1)
    reach = after + recipe.topup_stall_margin * rate * max(cap - spent, 0)
    if reach >= sought:
        return None
    return (f"stalled: held-out ESS {before:.3g} -> {after:.3g} over {drawn} LM samples; at "
            f"{recipe.topup_stall_margin:g}x that rate the cap of {cap} would reach "
            f"{reach:.3g}, short of {sought:g}")


def _judge_round(r: int, fit: _Fit, fresh, candidate) -> tuple[bool, dict]:
    """Keep a planned round's refit only when it beats the current controller on the round's
    fresh completions by more than ``min_gain_se`` standard errors."""
    gain, se = _gain_on_fresh(candidate, fit.controller, fit.pool, fresh, fit.pooled)
    keep = bool(np.isfinite(gain) and gain > fit.controller.min_gain_se * se)
    log.info("round %d: refit gains %.3g ± %.3g nats on fresh rollouts: %s", r, gain, se,
             "kept" if keep else "previous controller kept")
    return keep, _round_entry(r, fresh, fit.pooled, candidate, kept=keep,
                              gain_over_previous=gain, gain_se=se)


def _topup_entry(r: int, fit: _Fit, fresh, candidate, proposer, mix: float,
                 regular: bool, recipe: FitRecipe) -> dict:
    before = fit.controller
    entry = _round_entry(r, fresh, fit.pooled, candidate, kept=True)
    ess, floor = before.heldout_effective_samples_, before.min_target_samples
    entry.update({
        "kind": "round" if regular else "top-up",
        "reason": (f"thin evidence: held-out target ESS {ess:.3g} below the floor {floor:g}"
                   if ess < floor else
                   f"near the floor: held-out target ESS {ess:.3g} below "
                   f"{recipe.evidence_band:g} x the floor {floor:g} (decision "
                   f"'{before.fallback_reason_ or 'trusted'}' not yet stable)"),
        # None: a masking-only source (draws_controllers False) drew plain masked rollouts
        "proposal_beta": None if proposer is None else float(proposer.beta_),
        "proposal_defensive": float(mix),
        "heldout_ess_before": float(before.heldout_effective_samples_),
        "heldout_ess_after": float(candidate.heldout_effective_samples_),
        "decision_after": candidate.decision_, "lm_samples_total": int(fit.spent),
        # the same pool weighted by each completion's own proposal ratio, for contrast
        "heldout_ess_own_ratio": effective_sample_size(target_weights(fit.pool))})
    source = ("masking (the source samples masking only)" if proposer is None else
              f"the untrusted fit (β {proposer.beta_:.3g}, defensive {mix:.2g})")
    log.warning("top-up %d: %d LM samples from %s: held-out ESS %.3g -> %.3g; %s", r,
                fresh.n_completions, source, before.heldout_effective_samples_,
                candidate.heldout_effective_samples_, candidate.decision_)
    return entry


_DATA_KEYS = ("n_samples", "n_rows", "n_states", "valid_fraction", "truncated", "cut",
              "masker_rejected_valid", "masker_accepted_invalid", "sampling", "sample_seconds",
              "forward_tokens")


def _record_training(training: dict[str, Any], fit: _Fit, recipe: FitRecipe) -> None:
    """The manifest's training record: what was drawn, how it was weighted, every round."""
    if len(fit.parts) > 1:  # every LM sample drawn, by the balance heuristic
        training["p_valid_estimate_pooled"] = fit.pooled.p_valid_estimate
    training["max_samples"] = int(fit.cap)
    training["lm_samples_total"] = int(fit.spent)
    fit.controller.target_ = fit.chosen
    fit.controller.prompting_ = dict(training.get("prompting", {}))
    training.update({f"data_{k}": fit.pool.manifest[k] for k in _DATA_KEYS
                     if k in fit.pool.manifest})
    training["target_effective_samples"] = fit.targets.effective_target_samples
    training["target_clipped_fraction"] = fit.targets.clipped_fraction
    training["rounds"] = fit.history
    training["features"] = fit.history[0].get("features")
    if "prompt_set" in training:  # what the trust decision was judged on
        training["heldout_holds_out"] = ("prompts" if getattr(fit.controller, "cv_groups_", "")
                                         == "groups" else "completions")
    valid_total = int(np.sum(fit.pool.valid))
    training["forward_tokens_per_valid_sample"] = (
        float(fit.pool.manifest.get("forward_tokens", 0)) / valid_total if valid_total
        else None)
    if fit.chosen == "bootstrap":
        training["bootstrap_rounds"] = recipe.bootstrap_rounds


def _write(controller, masker, lm, prompt: str, training: dict[str, Any],
           output_dir) -> tuple[Any, dict[str, Any]]:
    if output_dir is not None:
        manifest = save_controller(output_dir, controller, masker, lm, prompt=prompt,
                                   training=training)
    else:
        manifest = build_manifest(controller, masker, lm, prompt=prompt, training=training)
    controller.fitted_prompts_ = FittedPrompts.from_manifest(manifest)  # the wrappers warn
    return controller, manifest


@dataclass
class _Part:
    """One draw of a pooled fit and the proposal it came from (None: plain masking)."""

    data: Any
    proposer: Any
    defensive: float
    row_logprob: dict = field(default_factory=dict)  # per pooled proposal index: log q of rows


def _pooled_targets(pool, parts: list[_Part]):
    """Rollout targets of the pool; with several proposals, the completions' target weights
    by the balance heuristic (:func:`~shim_adapters.shim.targets.mixture_target_weights`): every
    completion is scored under every part's proposal (cached per part, so a top-up only
    scores the new part's rows and the new proposal)."""
    pooled = make_targets("rollout", pool)
    if len(parts) < 2:
        return pooled
    per_proposal = []
    for k, proposal in enumerate(parts):
        rows = []
        for part in parts:
            if k not in part.row_logprob:
                part.row_logprob[k] = (masked_row_logprob(part.data) if proposal.proposer is None
                                       else shim_row_logprob(part.data, proposal.proposer,
                                                             proposal.defensive))
            rows.append(part.row_logprob[k])
        per_proposal.append(np.concatenate(rows))
    counts = [p.data.n_completions for p in parts]
    pooled.completion_weight = mixture_target_weights(pool, per_proposal, counts)
    pooled.p_valid_estimate = float(np.mean(mixture_target_weights(pool, per_proposal, counts,
                                                                   scaled=False)))
    return pooled


def _round_entry(r: int, data, targets, controller, *, kept: bool,
                 gain_over_previous: float | None = None, gain_se: float | None = None) -> dict:
    return {"round": r, "proposal": data.manifest.get("sampling", {}).get("proposal"),
            "n_samples": int(data.n_completions), "valid_count": int(np.sum(data.valid)),
            "forward_tokens": data.manifest.get("forward_tokens"),
            "beta": float(controller.beta_), "reg": float(controller.reg_),
            "heldout_kl_gain": float(controller.heldout_kl_gain_),
            "heldout_kl_gain_se": float(controller.heldout_kl_gain_se_),
            "heldout_best_beta": float(controller.heldout_best_beta_),
            "heldout_effective_samples": float(controller.heldout_effective_samples_),
            "fallback_reason": getattr(controller, "fallback_reason_", None),
            "falls_back_to_masking": bool(controller.falls_back_to_masking_),
            "target_effective_samples": float(targets.effective_target_samples),
            "gain_over_previous": gain_over_previous, "gain_over_previous_se": gain_se,
            "kept": kept}


def _gain_on_fresh(candidate, current, pool, fresh, pooled) -> tuple[float, float]:
    """Importance-weighted held-out gain of ``candidate`` over ``current`` on the fresh round's
    completions (the last ``fresh.n_completions`` of ``pool``): ``current`` never saw them;
    ``candidate`` is scored by its own cross-validation (out-of-fold) predictions."""
    n_fresh = fresh.n_completions
    idx = np.arange(pool.n_completions - n_fresh, pool.n_completions)
    w = pooled.completion_weight[idx]
    if not w.sum() > 0:
        return float("nan"), float("nan")
    cand = candidate.heldout_per_completion_[idx]
    cur = current.heldout_loglik(pool, idx)
    p = w / w.sum()
    d = cand - cur
    gain = float(d @ p)
    se = float(np.sqrt(np.sum(p ** 2 * (d - gain) ** 2)))
    return gain, se
