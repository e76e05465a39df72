"""``shim fit --engine URL``: the fit's rollouts come from served engines, the fit runs here.

:class:`EngineRollouts` is a :class:`~shim_adapters.shim.fitting.Rollouts` source: masked
rollouts collected from the engines (:mod:`shim_adapters.shim.engine_rollouts`) and replayed
through this process's masker. :func:`fit_from_engines` checks the engines against the local
tokenizer and weights, writes the masking artefact the engines sample with, and runs the same
fitting steps as the in-process fit (:func:`~shim_adapters.shim.fitting.run_recipe`).

What differs from the in-process fit, and why:

- Only masked rollouts come from the engine. In process, later rounds and thin-evidence
  top-ups draw from a defensive mixture of masking and the current controller, which the
  engine's processor does not sample; so an engine fit's later rounds and top-ups (held-out
  evidence thin, up to ``max_samples``) draw more masked rollouts
  (``EngineRollouts.draws_controllers`` is False; ``training.rounds`` records each draw's
  proposal). A fit still not trusted at the cap falls back to masking as usual.
- The prompt is used as given (no chat template, no newline folding probe: both need the
  LM's own logits here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from transformers import AutoConfig, AutoTokenizer

from shim_adapters.errors import ShimError
from shim_adapters.lm.engine_client import EngineClient, ServedModel
from shim_adapters.lm.loading import DEFAULT_SPECS, default_lm_path, weights_digest
from shim_adapters.mask.protocol import Masker
from shim_adapters.shim.artefact import load_controller, save_controller
from shim_adapters.shim.engine_rollouts import (
    EngineRecord,
    EngineSettings,
    RolloutStore,
    check_engines,
    collect_rollouts,
    replay_rollouts,
)
from shim_adapters.shim.fitting import FitRecipe, _write, run_recipe
from shim_adapters.shim.prompt_set import prompt_ids_sha256
from shim_adapters.shim.targets import make_targets
from shim_adapters.shim.training_data import TrainingData

#: Subdirectory of the collection directory holding the masking artefact (β = 0).
MASKING_ARTEFACT = "masking-artefact"
#: Random masked walks that give the masking artefact's (unused) controller its features.
MASKING_WALKS = 64


@dataclass(frozen=True)
class EngineLM:
    """The LM an engine serves, as a manifest names it (no model loaded)."""

    identifier: str
    revision: str


@dataclass(frozen=True)
class LocalTokenizer:
    """The served LM's tokenizer and logits width, read from its files (the model never
    loads): what the masker compiles for."""

    path: Path
    tokenizer: Any
    vocab_size: int


def local_tokenizer(spec: str | Path | None) -> LocalTokenizer:
    """``spec``: ``default`` (the shipped LM) or a local model directory."""
    path = default_lm_path() if spec is None or str(spec) in DEFAULT_SPECS \
        else Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"--lm {spec}: an engine fit needs the served model's directory "
                                f"here (its tokenizer and config; the weights are hashed, not "
                                f"loaded)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    width = int(getattr(config.get_text_config(), "vocab_size", 0) or len(tokenizer))
    return LocalTokenizer(path, tokenizer, max(width, len(tokenizer)))


class EngineRollouts:
    """Masked rollouts drawn by the engines, replayed here (a ``Rollouts`` source)."""

    def __init__(self, clients: Sequence[EngineClient], model: ServedModel, masker: Masker,
                 prompt: str, prompt_ids: Sequence[int], lm: EngineLM, directory: Path,
                 settings: EngineSettings, *, progress: bool = True) -> None:
        self.clients = list(clients)
        self.model = model
        self.masker = masker
        self.prompt = prompt
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.lm = lm
        self.directory = Path(directory)
        self.settings = settings
        self.progress = progress

    def header(self, seed: int) -> dict[str, Any]:
        return {"model": {"id": self.model.id, "root": self.model.root},
                "lm_revision": self.lm.revision, **self.masker.fingerprint(),
                "prompt_ids": self.prompt_ids, "seed": int(seed),
                "sampling": self.settings.sampling(),
                "masking_artefact": self.settings.masking_artefact}

    def records(self, n: int, seed: int) -> list[EngineRecord]:
        """Rollouts ``0..n-1`` of the draw seeded ``seed``, collecting the missing ones."""
        store = RolloutStore(self.directory / f"rollouts-seed{seed}.jsonl", self.header(seed))
        return collect_rollouts(self.clients, self.model, store, n, self.prompt_ids, seed,
                                self.settings, progress=self.progress)

    #: The engine's processor runs in masking mode: later rounds and top-ups draw masked
    #: rollouts too (a controller's defensive mixture would need the per-step allowed mass of
    #: both distributions, which the engine's log-probs do not carry).
    draws_controllers = False

    def draw(self, n: int, proposal: str, seed: int, controller=None,
             defensive: float = 0.0) -> TrainingData:
        if proposal != "masked":
            raise ValueError(f"engine rollouts are masked rollouts; a {proposal!r} draw needs "
                             f"the controller's defensive mixture inside the engine, which its "
                             f"processor does not sample (draws_controllers is False)")
        records = self.records(n, seed)
        return replay_rollouts(records, self.masker, prompt=self.prompt,
                               eos=self.masker.eos_token_ids, seed=seed, settings=self.settings,
                               lm_fields={"lm_identifier": self.lm.identifier,
                                          "lm_revision": self.lm.revision},
                               engine=self.engine_record())

    def engine_record(self) -> dict[str, Any]:
        return {"urls": [c.url for c in self.clients], "model": self.model.id,
                "model_root": self.model.root, "max_model_len": self.model.max_model_len,
                **self.settings.sampling(), "masking_artefact": self.settings.masking_artefact}


def masking_walks(masker: Masker, n: int, max_steps: int, seed: int) -> list[EngineRecord]:
    """Uniform random masked walks through the grammar (no LM): the states a masking artefact's
    feature encoder is built from."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        state = masker.new_state()
        tokens, lps = [], []
        for _ in range(max_steps):
            allowed = np.flatnonzero(state.allowed_mask())
            if len(allowed) == 0:
                break
            token = int(rng.choice(allowed))
            tokens.append(token)
            lps.append(-float(np.log(len(allowed))))
            state.advance(token)
            if token in masker.eos_token_ids:
                break
        out.append(EngineRecord(index=i, seed=seed, engine="masking-walk", token_ids=tokens,
                                proposal_logprobs=lps, lm_logprobs=lps,
                                top=[{} for _ in tokens], finish_reason=None))
    return out


def write_masking_artefact(directory: Path, masker: Masker, lm: EngineLM, *,
                           max_steps: int = 64) -> Path:
    """A controller artefact with β = 0 for ``masker``'s grammar, backend and tokenizer: the
    SHIM processor masks with it and adds nothing (its adjuster is inert)."""
    settings = EngineSettings(max_new_tokens=max_steps, allowed_min_prob=None)
    walks = masking_walks(masker, MASKING_WALKS, max_steps, seed=0)
    data = replay_rollouts(walks, masker, prompt="", eos=masker.eos_token_ids, seed=0,
                           settings=settings, lm_fields=dataclasses.asdict(lm),
                           engine={"masking_walks": MASKING_WALKS})
    targets = make_targets("rollout", data)
    controller = FitRecipe(kind="LR_NT").new_controller().fit(
        targets.data, y=targets.y, completion_weight=targets.completion_weight)
    controller.beta_ = 0.0
    controller.falls_back_to_masking_ = True
    save_controller(directory, controller, masker, lm,
                    training={"purpose": "masking artefact: beta = 0, the SHIM processor masks "
                                         "only (engine rollouts for shim fit --engine)"})
    return Path(directory)


def masking_artefact_for(directory: Path, masker: Masker, lm: EngineLM) -> Path:
    """The masking artefact in ``directory``: the one there when it loads for this masker and
    LM with β = 0 (a resumed collection keeps the artefact its rollouts were drawn with), else
    a new one."""
    if (Path(directory) / "manifest.json").exists():
        try:
            controller, _ = load_controller(directory, masker, lm)
        except (ShimError, OSError, ValueError):
            controller = None
        if controller is not None and controller.beta_ == 0.0:
            return Path(directory)
    return write_masking_artefact(directory, masker, lm)


def fit_from_engines(urls: Sequence[str], masker: Masker, tokenizer, lm_path: str | Path,
                     prompt: str, recipe: FitRecipe, directory: str | Path, *,
                     output_dir: str | Path | None = None, top_logprobs: int = 20,
                     masking_artefact: str | None = None, concurrency: int = 8,
                     timeout: float = 300.0) -> tuple[Any, dict[str, Any]]:
    """Fit a controller from rollouts of the engines at ``urls`` (vLLM servers with the SHIM
    processor and ``--logprobs-mode processed_logprobs``), the LM never loaded here.

    ``tokenizer`` and ``lm_path`` (a model directory or ``.gguf``: its weights are hashed, not
    loaded) name the LM the engines must serve; engines serving another model or tokenizer are
    refused before any rollout. ``directory`` keeps the collection (resumable) and, unless
    ``masking_artefact`` names one as the engines see it, the masking artefact (the engines must
    see it at the same path: a local server or a shared filesystem)."""
    clients = [EngineClient(u, timeout=timeout) for u in urls]
    lm = EngineLM(identifier=str(Path(lm_path).expanduser().resolve()),
                  revision=weights_digest(lm_path))
    model = check_engines(clients, tokenizer, prompt, lm_revision=lm.revision,
                          served_revision=_local_weights_digest)
    directory = Path(directory).expanduser().resolve()
    if masking_artefact is None:
        masking_artefact = str(masking_artefact_for(directory / MASKING_ARTEFACT, masker, lm))
    settings = EngineSettings(max_new_tokens=recipe.max_new_tokens, top_logprobs=top_logprobs,
                              masking_artefact=str(masking_artefact), concurrency=concurrency)
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    rollouts = EngineRollouts(clients, model, masker, prompt, prompt_ids, lm, directory,
                              settings, progress=recipe.progress)
    training: dict[str, Any] = {
        "prompting": {"chat": False, "stop_at_newline": False,
                      "prompt_ids_sha256": [prompt_ids_sha256(prompt_ids)]},
        "engine": {**rollouts.engine_record(), "collection": str(directory),
                   "proposals": "masked in every round and top-up (the engine samples "
                                "masking only)"}}
    controller = run_recipe(rollouts, recipe, training)
    return _write(controller, masker, lm, prompt, training, output_dir)


def _local_weights_digest(root: str) -> str | None:
    """The served model's weights digest when its path is on this machine, else None."""
    path = Path(root).expanduser()
    if not path.exists():
        return None
    try:
        return weights_digest(path)
    except (FileNotFoundError, ValueError):
        return None
