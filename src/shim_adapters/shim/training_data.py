"""SHIM's training data: LM completions replayed through a masker, one row per token.

:func:`sample_training_data` draws N completions of a prompt with the sampling engine
(:mod:`shim_adapters.lm.sampling`): unconstrained (the paper's recipe), masked, or SHIM-corrected.
One row per generated token holds the state features before the token, the token, the LM's
exact log-probability of it, the log LM mass ``log Z`` of the tokens the masker allows there,
the token's log-probability under the proposal it was drawn from, and the allowed set with the
LM's log-probabilities (needed to score the per-step distribution that SHIM renormalises).
An unconstrained completion's rows stop at the first token the masker rejects.

Every row carries its completion's 0/1 label: 1 when the finished output is a string of the
language -- the reference acceptor (never the masker) accepts its text *and* the masker
consumed it up to EOS, so it is reachable by masked decoding -- else 0. A completion cut by
``max_new_tokens`` is invalid. Disagreements between masker and reference are counted in the
manifest (``masker_rejected_valid``, ``masker_accepted_invalid``) since they are backend bugs.
Soft labels for valid-only proposals are computed from the rows by :mod:`shim_adapters.shim.targets`.

On disk (:meth:`TrainingData.save`): a directory with ``training_data.safetensors`` (flat
arrays; ragged ones as ``values`` + ``offsets`` pairs) and ``training_data.json`` (manifest,
sample texts, the table of distinct states). Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from shim_adapters.errors import VocabMismatchError
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.sampling import eos_ids, prefill, sample
from shim_adapters.mask.protocol import (
    FEATURE_NAMES,
    Masker,
    StateFeatures,
    canonical_value,
    state_key,
)
from shim_adapters.shim.correction import ShimAdjuster

FORMAT_VERSION = 2
TENSORS_FILE = "training_data.safetensors"
MANIFEST_FILE = "training_data.json"


def _ragged(arrays: Sequence[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(a) for a in arrays])
    values = (np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if len(arrays)
              else np.zeros(0, dtype=dtype))
    return values.astype(dtype, copy=False), offsets


@dataclass
class TrainingData:
    """Rows (one per replayed token) and the completions they came from.

    Ragged per-completion arrays are ``*_values`` + ``*_offsets``; per-row allowed sets are
    ``allowed_token_ids`` / ``allowed_lm_logprobs`` sliced by ``allowed_offsets``.
    """

    # per completion
    completion_offsets: np.ndarray  #: int64 (N+1): tokens of completion i are [o[i], o[i+1])
    completion_token_ids: np.ndarray  #: int32, EOS included when emitted
    completion_token_logprobs: np.ndarray  #: float32, exact LM log-prob of each sampled token
    valid: np.ndarray  #: bool (N): reference accepts and masker consumed through EOS
    reference_accepts: np.ndarray  #: bool (N)
    masker_complete: np.ndarray  #: bool (N): the masker consumed every token incl. EOS
    truncated: np.ndarray  #: bool (N): no EOS within max_new_tokens
    cut_step: np.ndarray  #: int32 (N): step of the first token the masker rejected, -1 if none
    texts: list[str]
    # per row
    states: list[StateFeatures]  #: distinct states; rows index into it
    row_completion: np.ndarray  #: int32
    row_step: np.ndarray  #: int32
    row_state: np.ndarray  #: int32 into ``states``
    row_token: np.ndarray  #: int32
    row_lm_logprob: np.ndarray  #: float32, log p(token | prefix)
    row_log_z: np.ndarray  #: float32, log of the LM mass of the allowed set
    #: float32, log q(token | prefix) under the proposal the completion was drawn from
    row_proposal_logprob: np.ndarray
    row_label: np.ndarray  #: float32 in [0, 1]
    allowed_offsets: np.ndarray  #: int64 (rows+1)
    allowed_token_ids: np.ndarray  #: int32
    allowed_lm_logprobs: np.ndarray  #: float32
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def n_completions(self) -> int:
        return len(self.valid)

    @property
    def n_rows(self) -> int:
        return len(self.row_token)

    def completion_tokens(self, i: int) -> np.ndarray:
        return self.completion_token_ids[self.completion_offsets[i]:self.completion_offsets[i + 1]]

    def allowed(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.allowed_offsets[row], self.allowed_offsets[row + 1]
        return self.allowed_token_ids[a:b], self.allowed_lm_logprobs[a:b]

    # ---- persistence ----------------------------------------------------------------------
    _TENSORS = ("completion_offsets", "completion_token_ids", "completion_token_logprobs",
                "valid", "reference_accepts", "masker_complete", "truncated", "cut_step",
                "row_completion", "row_step", "row_state", "row_token", "row_lm_logprob",
                "row_log_z", "row_proposal_logprob", "row_label", "allowed_offsets", "allowed_token_ids",
                "allowed_lm_logprobs")

    def save(self, directory: str | Path) -> Path:
        """Write ``training_data.safetensors`` + ``training_data.json`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name in self._TENSORS:
            arr = np.ascontiguousarray(getattr(self, name))
            tensors[name] = arr.astype(np.uint8) if arr.dtype == bool else arr
        save_file(tensors, str(directory / TENSORS_FILE))
        digest = hashlib.sha256((directory / TENSORS_FILE).read_bytes()).hexdigest()
        doc = {"format": "shim-adapters training data", "format_version": FORMAT_VERSION,
               "manifest": self.manifest, "tensors_sha256": digest, "texts": self.texts,
               "states": [_state_to_json(s) for s in self.states]}
        (directory / MANIFEST_FILE).write_text(json.dumps(doc, ensure_ascii=False))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "TrainingData":
        directory = Path(directory)
        doc = json.loads((directory / MANIFEST_FILE).read_text())
        if doc.get("format_version") not in (1, FORMAT_VERSION):
            raise ValueError(f"{directory}: training data format {doc.get('format_version')} "
                             f"is not {FORMAT_VERSION}")
        digest = hashlib.sha256((directory / TENSORS_FILE).read_bytes()).hexdigest()
        if digest != doc["tensors_sha256"]:
            raise ValueError(f"{directory / TENSORS_FILE}: sha256 {digest} does not match the "
                             f"manifest's {doc['tensors_sha256']} (truncated or modified)")
        t = load_file(str(directory / TENSORS_FILE))
        if "row_proposal_logprob" not in t:  # format 1: LM or masked proposals only
            masked = doc["manifest"].get("sampling", {}).get("proposal") == "masked"
            t["row_proposal_logprob"] = (t["row_lm_logprob"] - t["row_log_z"]) if masked \
                else t["row_lm_logprob"].copy()
        kwargs = {name: (t[name].astype(bool) if name in ("valid", "reference_accepts",
                                                          "masker_complete", "truncated")
                         else t[name]) for name in cls._TENSORS}
        return cls(**kwargs, texts=list(doc["texts"]),
                   states=[_state_from_json(s) for s in doc["states"]],
                   manifest=doc["manifest"])

    def subset(self, completions: np.ndarray) -> "TrainingData":
        """The data restricted to some completions (renumbered), for cross-validation."""
        completions = np.asarray(completions, dtype=np.int64)
        tok = [self.completion_tokens(i) for i in completions]
        lps = [self.completion_token_logprobs[self.completion_offsets[i]:
                                              self.completion_offsets[i + 1]] for i in completions]
        new_id = np.full(self.n_completions, -1, dtype=np.int64)
        new_id[completions] = np.arange(len(completions))
        rows = np.flatnonzero(new_id[self.row_completion] >= 0)
        rows = rows[np.argsort(new_id[self.row_completion[rows]], kind="stable")]
        allowed_ids = [self.allowed(r)[0] for r in rows]
        allowed_lp = [self.allowed(r)[1] for r in rows]
        a_ids, a_off = _ragged(allowed_ids, np.int32)
        a_lp, _ = _ragged(allowed_lp, np.float32)
        c_ids, c_off = _ragged(tok, np.int32)
        c_lp, _ = _ragged(lps, np.float32)
        return TrainingData(
            completion_offsets=c_off, completion_token_ids=c_ids, completion_token_logprobs=c_lp,
            valid=self.valid[completions], reference_accepts=self.reference_accepts[completions],
            masker_complete=self.masker_complete[completions],
            truncated=self.truncated[completions], cut_step=self.cut_step[completions],
            texts=[self.texts[i] for i in completions], states=self.states,
            row_completion=new_id[self.row_completion[rows]].astype(np.int32),
            row_step=self.row_step[rows], row_state=self.row_state[rows],
            row_token=self.row_token[rows], row_lm_logprob=self.row_lm_logprob[rows],
            row_log_z=self.row_log_z[rows],
            row_proposal_logprob=self.row_proposal_logprob[rows], row_label=self.row_label[rows],
            allowed_offsets=a_off, allowed_token_ids=a_ids, allowed_lm_logprobs=a_lp,
            manifest=dict(self.manifest))


def concat_training_data(parts: Sequence[TrainingData]) -> TrainingData:
    """Several draws (e.g. the rounds of an iterated fit) as one data set: completions are
    renumbered in order, the state tables merged. Each completion keeps the proposal it was
    drawn from (``row_proposal_logprob``), so its labels and weights stay its own; the
    manifest is the first part's, with ``parts`` listing every part's sampling."""
    if not parts:
        raise ValueError("nothing to concatenate")
    if len(parts) == 1:
        return parts[0]
    state_ids: dict[tuple, int] = {}
    states: list[StateFeatures] = []
    fields: dict[str, list[np.ndarray]] = {k: [] for k in TrainingData._TENSORS}
    texts: list[str] = []
    comp_base = tok_base = allowed_base = 0
    for part in parts:
        remap = np.empty(len(part.states), dtype=np.int32)
        for j, st in enumerate(part.states):
            key = state_key(st)
            sid = state_ids.get(key)
            if sid is None:
                sid = state_ids[key] = len(states)
                states.append(st)
            remap[j] = sid
        for name in TrainingData._TENSORS:
            arr = getattr(part, name)
            if name == "completion_offsets":
                arr = arr[:-1] + tok_base if part is not parts[-1] else arr + tok_base
            elif name == "allowed_offsets":
                arr = arr[:-1] + allowed_base if part is not parts[-1] else arr + allowed_base
            elif name == "row_completion":
                arr = arr + comp_base
            elif name == "row_state":
                arr = remap[arr]
            fields[name].append(np.asarray(arr))
        texts.extend(part.texts)
        comp_base += part.n_completions
        tok_base += len(part.completion_token_ids)
        allowed_base += len(part.allowed_token_ids)
    merged = {k: np.concatenate(v) for k, v in fields.items()}
    manifest = dict(parts[0].manifest)
    manifest["parts"] = [dict(p.manifest.get("sampling", {}), n_samples=p.n_completions,
                              valid_count=int(np.sum(p.valid)),
                              forward_tokens=p.manifest.get("forward_tokens"))
                         for p in parts]
    manifest["n_samples"] = comp_base
    manifest["n_rows"] = int(len(merged["row_token"]))
    manifest["n_states"] = len(states)
    manifest["valid_fraction"] = float(np.mean(merged["valid"]))
    manifest["forward_tokens"] = int(sum(p.manifest.get("forward_tokens") or 0 for p in parts))
    manifest["sampling"] = dict(manifest.get("sampling", {}),
                                proposal="+".join(sorted({proposal_name(p) for p in parts})))
    return TrainingData(**merged, texts=texts, states=states, manifest=manifest)


def proposal_name(data: TrainingData) -> str:
    """``"lm"``, ``"masked"``, ``"shim"`` or a ``+``-joined mix: how the data was drawn."""
    return str(data.manifest.get("sampling", {}).get("proposal", "lm"))


def _state_to_json(s: StateFeatures) -> dict:
    return {"parser_state": None if s.parser_state is None else list(s.parser_state),
            "lexer_state": None if s.lexer_state is None else sorted([t, int(p)] for t, p
                                                                     in s.lexer_state),
            "partial_lexeme": s.partial_lexeme,
            "extra": {str(k): canonical_value(v) for k, v in (s.extra or {}).items()}}


def _state_from_json(d: dict) -> StateFeatures:
    return StateFeatures(
        parser_state=None if d["parser_state"] is None else tuple(d["parser_state"]),
        lexer_state=None if d["lexer_state"] is None else frozenset(
            (t, int(p)) for t, p in d["lexer_state"]),
        partial_lexeme=d["partial_lexeme"], extra=dict(d["extra"]))


def _normalised(s: StateFeatures) -> StateFeatures:
    """Extras as canonical strings, so fresh and reloaded data encode identically."""
    if not s.extra:
        return s
    return StateFeatures(s.parser_state, s.lexer_state, s.partial_lexeme,
                         {str(k): canonical_value(v) for k, v in s.extra.items()})


def lm_fingerprint(lm) -> dict[str, str]:
    return {"lm_identifier": str(lm.identifier), "lm_revision": str(lm.revision)}


#: How :func:`sample_training_data` may draw its completions.
PROPOSALS = ("lm", "masked", "shim")


class _RowRecorder:
    """Collects one row per replayed token from the sampling engine (features before the
    token, the token, the stored part of the allowed set)."""

    def __init__(self, log_threshold: float | None, max_stored: int | None) -> None:
        self.log_threshold = log_threshold
        self.max_stored = max_stored
        self.state_ids: dict[tuple, int] = {}
        self.states: list[StateFeatures] = []
        self.rows: list[tuple[int, int, int, int, float, float]] = []
        self.allowed_ids: list[np.ndarray] = []
        self.allowed_lps: list[np.ndarray] = []

    def record(self, row, step, state, token, logp, mask, log_z) -> None:
        feats = _normalised(state.features())
        key = state_key(feats)
        sid = self.state_ids.get(key)
        if sid is None:
            sid = self.state_ids[key] = len(self.states)
            self.states.append(feats)
        allowed = np.flatnonzero(mask)
        la = logp[allowed]
        if self.log_threshold is not None:
            keep = (la - log_z >= self.log_threshold) | (allowed == token)
            allowed, la = allowed[keep], la[keep]
        if self.max_stored is not None and len(allowed) > self.max_stored:
            keep = np.zeros(len(allowed), dtype=bool)
            keep[np.argsort(-la, kind="stable")[:self.max_stored]] = True
            keep |= allowed == token
            allowed, la = allowed[keep], la[keep]
        self.rows.append((row, step, sid, token, float(logp[token]), log_z))
        self.allowed_ids.append(allowed.astype(np.int32))
        self.allowed_lps.append(la.astype(np.float32))

    def retract(self, row: int) -> None:
        """The masker refused the token just recorded for ``row``: drop that row."""
        if self.rows and self.rows[-1][0] == row:
            self.rows.pop()
            self.allowed_ids.pop()
            self.allowed_lps.pop()


def sample_training_data(lm, masker: Masker, prompt: str, n_samples: int = 1000, *,
                         max_new_tokens: int = 128, batch_size: int = 64, seed: int = 0,
                         allowed_min_prob: float | None = 1e-8,
                         allowed_max_stored: int | None = 4096,
                         progress: bool = True, proposal: str = "lm", controller=None,
                         defensive: float = 0.0, prefilled=None) -> TrainingData:
    """Draw ``n_samples`` completions of ``prompt`` with the sampling engine and replay them.

    ``proposal``: ``"lm"`` (unconstrained, the paper's data: every row labelled by final
    validity), ``"masked"`` (masked decoding: every row is a state masked decoding visits) or
    ``"shim"`` (masked decoding corrected by ``controller``, optionally mixed with masking by
    ``defensive``). Masked and SHIM completions only emit strings of L, so the importance ratio
    p/q of each suffix (``row_proposal_logprob`` against ``row_lm_logprob``) gives every row a
    soft label (:mod:`shim_adapters.shim.targets`). An unconstrained completion stops at the masker's
    first refusal, where it can no longer be valid and its later rows carry nothing for the
    controller; this saves most of the LM's work when the LM is rarely valid, at the price of
    not counting valid strings the masker wrongly refuses (``masker_rejected_valid`` covers the
    uncut completions only; the conformance suite is where masker bugs are hunted).

    ``lm`` is a :class:`shim_adapters.lm.loading.LoadedLM`; ``prefilled`` may hand in the prompt's
    :class:`~shim_adapters.lm.sampling.PrefilledPrompt` (the prompt then is its text).
    ``allowed_min_prob``: allowed tokens whose LM probability relative to the allowed mass Z is
    below this are not stored (``row_log_z`` is always exact); None keeps every allowed token.
    ``allowed_max_stored`` caps the stored allowed set per row at its most likely tokens (the
    sampled token is always kept).
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {', '.join(PROPOSALS)}, not {proposal!r}")
    if (proposal == "shim") != (controller is not None):
        raise ValueError("proposal='shim' needs a fitted controller (and only it takes one)")
    if masker.vocab_size != lm.vocab_size:
        raise VocabMismatchError(f"masker was compiled for logits of width {masker.vocab_size} "
                                 f"but the LM {lm.identifier} has {lm.vocab_size}")
    eos = eos_ids(lm, masker)
    pre = prefilled if prefilled is not None else prefill(lm, prompt)
    gen = torch.Generator().manual_seed(seed)
    recorder = _RowRecorder(None if allowed_min_prob is None else float(np.log(allowed_min_prob)),
                            allowed_max_stored)
    masked = proposal != "lm"
    adjuster = ShimAdjuster(controller) if controller is not None else None
    t0 = time.perf_counter()
    drawn = sample(pre, n_samples, masker=masker if masked else None, adjuster=adjuster,
                   defensive=defensive if controller is not None else 0.0,
                   watch=None if masked else masker, max_new_tokens=max_new_tokens,
                   batch_size=batch_size, generator=gen, recorder=recorder, progress=progress,
                   progress_label=f"sampling completions ({proposal})")
    sample_seconds = time.perf_counter() - t0
    sampling = {"proposal": proposal, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                "seed": seed, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                "allowed_min_prob": allowed_min_prob, "allowed_max_stored": allowed_max_stored,
                "cut_at_first_refusal": not masked}
    if controller is not None:
        sampling["controller"] = {"kind": controller.kind,
                                  "beta": float(getattr(controller, "beta_", float("nan"))),
                                  "defensive": defensive}
    return training_data_from_samples(drawn, recorder, masker, prompt=pre.prompt, eos=eos,
                                      sampling=sampling, sample_seconds=sample_seconds,
                                      lm_fields=lm_fingerprint(lm))


def training_data_from_samples(drawn, recorder: "_RowRecorder", masker: Masker, *, prompt: str,
                               eos, sampling: dict[str, Any], sample_seconds: float,
                               lm_fields: dict[str, str]) -> TrainingData:
    """Training data from completions and the rows recorded while they were drawn (or
    replayed): labels from the reference acceptor, the manifest. ``drawn`` is a
    :class:`~shim_adapters.lm.sampling.Samples`; ``lm_fields``: the LM's identifier and
    revision (:func:`lm_fingerprint`)."""
    acceptor = reference_acceptor(masker.grammar)
    comp_tokens = drawn.token_ids
    truncated = np.array([not (t and t[-1] in eos) for t in comp_tokens], dtype=bool)
    was_cut = np.array(drawn.cut, dtype=bool)
    failed = np.array(drawn.failed, dtype=bool)
    texts = [masker.decode([x for x in t if x not in eos]) for t in comp_tokens]
    ref = np.array([acceptor.accepts(s) if not c else False for s, c in zip(texts, was_cut)],
                   dtype=bool)
    masker_complete = np.array([st.is_finished for st in drawn.states], dtype=bool) & \
        ~was_cut & ~failed
    valid = ref & masker_complete & ~truncated
    rows = recorder.rows
    row_arr = np.array(rows, dtype=np.float64).reshape(-1, 6)
    row_comp = row_arr[:, 0].astype(np.int32)
    row_step = row_arr[:, 1].astype(np.int32)
    row_lq = np.array([drawn.proposal_logprobs[c][k] for c, k in zip(row_comp, row_step)],
                      dtype=np.float32)
    c_ids, c_off = _ragged(comp_tokens, np.int32)
    c_lps, _ = _ragged(drawn.lm_logprobs, np.float32)
    a_ids, a_off = _ragged(recorder.allowed_ids, np.int32)
    a_lps, _ = _ragged(recorder.allowed_lps, np.float32)
    n = drawn.n
    manifest = {
        "prompt": prompt,
        "n_samples": n,
        "n_rows": len(rows),
        "n_states": len(recorder.states),
        "valid_fraction": float(valid.mean()),
        "valid_count": int(valid.sum()),
        "truncated": int(truncated.sum()),
        "cut": int(was_cut.sum()),
        "masker_rejected_valid": int((ref & ~truncated & ~masker_complete).sum()),
        "masker_accepted_invalid": int((masker_complete & ~ref).sum()),
        "masker_failures": int(failed.sum()),
        "sampling": sampling,
        "sample_seconds": sample_seconds,
        "forward_tokens": int(drawn.forward_tokens),
        "grammar_name": masker.grammar.name,
        "eos_token_ids": sorted(eos),
        **masker.fingerprint(),
        **lm_fields,
        "feature_status": {k: _status_value(masker.feature_status.get(k)) for k in FEATURE_NAMES},
    }
    return TrainingData(
        completion_offsets=c_off, completion_token_ids=c_ids, completion_token_logprobs=c_lps,
        valid=valid, reference_accepts=ref, masker_complete=masker_complete,
        truncated=truncated, cut_step=np.array([len(t) - 1 if c else -1 for t, c in
                                                zip(comp_tokens, was_cut)], dtype=np.int32),
        texts=texts, states=recorder.states, row_completion=row_comp, row_step=row_step,
        row_state=row_arr[:, 2].astype(np.int32), row_token=row_arr[:, 3].astype(np.int32),
        row_lm_logprob=row_arr[:, 4].astype(np.float32),
        row_log_z=row_arr[:, 5].astype(np.float32),
        row_proposal_logprob=row_lq,
        row_label=valid[row_comp].astype(np.float32),
        allowed_offsets=a_off, allowed_token_ids=a_ids, allowed_lm_logprobs=a_lps,
        manifest=manifest)


def _status_value(status) -> str:
    return "missing" if status is None else str(getattr(status, "value", status))
