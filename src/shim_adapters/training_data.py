"""SHIM's training data: unconstrained LM completions replayed through a masker.

:func:`sample_training_data` draws N completions of a prompt from the LM as it is (temperature
1, top-p 1, no top-k; own KV-cache loop), records each sampled token's exact log-probability,
and replays every completion through ``masker.new_state()`` *as it is sampled*: one row per
generated token holds the state features before the token, the token, the LM log-probability
of the token, the log LM mass ``log Z`` of the tokens the masker allows there, and the allowed
set itself with the LM's log-probabilities (needed to score the per-step distribution that SHIM
renormalises, and for masked-rollout soft targets: DESIGN.md section 2). A completion's rows
stop at the first token the masker rejects.

Every row carries its completion's label: 1 when the finished output is a string of the
language -- the reference acceptor (never the masker) accepts its text *and* the masker
consumed it up to EOS, so it is reachable by masked decoding -- else 0. A completion cut by
``max_new_tokens`` is invalid. Disagreements between masker and reference are counted in the
manifest (``masker_rejected_valid``, ``masker_accepted_invalid``) since they are backend bugs.

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
from transformers import DynamicCache

from .errors import DeadEndError, ForbiddenTokenError, VocabMismatchError
from .features import canonical_value, state_key
from .protocol import FEATURE_NAMES, Masker, StateFeatures
from .reference import reference_acceptor

FORMAT_VERSION = 1
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
                "row_log_z", "row_label", "allowed_offsets", "allowed_token_ids",
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
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{directory}: training data format {doc.get('format_version')} "
                             f"is not {FORMAT_VERSION}")
        digest = hashlib.sha256((directory / TENSORS_FILE).read_bytes()).hexdigest()
        if digest != doc["tensors_sha256"]:
            raise ValueError(f"{directory / TENSORS_FILE}: sha256 {digest} does not match the "
                             f"manifest's {doc['tensors_sha256']} (truncated or modified)")
        t = load_file(str(directory / TENSORS_FILE))
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
            row_log_z=self.row_log_z[rows], row_label=self.row_label[rows],
            allowed_offsets=a_off, allowed_token_ids=a_ids, allowed_lm_logprobs=a_lp,
            manifest=dict(self.manifest))


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


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("the prompt encodes to no tokens; the LM needs at least one token of "
                         "context (give a non-empty prompt)")
    return ids


def sample_training_data(lm, masker: Masker, prompt: str, n_samples: int = 1000, *,
                         max_new_tokens: int = 128, batch_size: int = 250, seed: int = 0,
                         allowed_min_prob: float | None = 1e-8,
                         allowed_max_stored: int | None = 4096,
                         progress: bool = True, proposal: str = "lm") -> TrainingData:
    """Sample ``n_samples`` unconstrained completions of ``prompt`` and replay them.

    ``proposal="masked"`` samples masked completions instead (the LM renormalised over the
    masker's allowed set at every step): every row is then a state masked decoding visits, and
    ``row_log_z`` along a completion gives the masked-rollout soft targets of
    :mod:`shim_adapters.targets` (DESIGN.md section 2). Labels stay 0/1 final validity.

    ``lm`` is a :class:`shim_adapters.lm.LoadedLM` (model, tokenizer, identifier, revision,
    vocab_size, eos_token_ids). ``allowed_min_prob``: allowed tokens whose LM probability
    relative to the allowed mass Z is below this are not stored (``row_log_z`` is always
    exact); None keeps every allowed token. ``allowed_max_stored`` caps the stored allowed set
    per row at its most likely tokens (the sampled token is always kept).
    """
    from tqdm.auto import tqdm

    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if proposal not in ("lm", "masked"):
        raise ValueError(f"proposal must be 'lm' (unconstrained) or 'masked', not {proposal!r}")
    masked = proposal == "masked"
    if masker.vocab_size != lm.vocab_size:
        raise VocabMismatchError(f"masker was compiled for logits of width {masker.vocab_size} "
                                 f"but the LM {lm.identifier} has {lm.vocab_size}")
    model, tokenizer = lm.model, lm.tokenizer
    eos = set(int(e) for e in masker.eos_token_ids) | set(int(e) for e in lm.eos_token_ids)
    pad = min(eos)
    acceptor = reference_acceptor(masker.grammar)
    prompt_ids = _prompt_ids(tokenizer, prompt)
    gen = torch.Generator().manual_seed(seed)
    log_threshold = None if allowed_min_prob is None else float(np.log(allowed_min_prob))

    state_ids: dict[tuple, int] = {}
    states: list[StateFeatures] = []
    comp_tokens: list[list[int]] = []
    comp_lps: list[list[float]] = []
    cut_steps: list[int] = []
    masker_done: list[bool] = []
    rows: list[tuple[int, int, int, int, float, float]] = []  # comp, step, state, tok, lp, logz
    allowed_ids: list[np.ndarray] = []
    allowed_lps: list[np.ndarray] = []

    t0 = time.perf_counter()
    bar = tqdm(total=n_samples, desc="sampling completions", unit="seq", disable=not progress)
    done_total = 0
    while done_total < n_samples:
        b = min(batch_size, n_samples - done_total)
        base = done_total
        mstates = [masker.new_state() for _ in range(b)]
        in_grammar = np.ones(b, dtype=bool)
        finished = np.zeros(b, dtype=bool)
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        cut = [-1] * b
        attention = torch.ones((b, prompt_ids.shape[1] + max_new_tokens), dtype=torch.long)
        with torch.no_grad():
            out = model(input_ids=prompt_ids.expand(b, -1), past_key_values=DynamicCache(),
                        attention_mask=attention[:, : prompt_ids.shape[1]], use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1, :]
            for step in range(max_new_tokens):
                logp = torch.log_softmax(logits.float(), dim=-1)
                masks = {}
                if masked:
                    live_mask = np.ones(logp.shape, dtype=bool)
                    for i in np.flatnonzero(~finished):
                        m = masks[i] = mstates[i].allowed_mask()
                        if not m.any():
                            raise DeadEndError(mstates[i].step, mstates[i].describe(), row=int(i))
                        live_mask[i] = m
                    probs = logp.masked_fill(~torch.from_numpy(live_mask), float("-inf")).exp()
                else:
                    probs = logp.exp()
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                logp_np, nxt_np = logp.numpy(), nxt.numpy()
                for i in np.flatnonzero(~finished):
                    t = int(nxt_np[i])
                    toks[i].append(t)
                    lps[i].append(float(logp_np[i, t]))
                    if in_grammar[i]:
                        st = mstates[i]
                        mask = masks[i] if masked else st.allowed_mask()
                        if mask[t]:
                            feats = _normalised(st.features())
                            key = state_key(feats)
                            sid = state_ids.get(key)
                            if sid is None:
                                sid = state_ids[key] = len(states)
                                states.append(feats)
                            allowed = np.flatnonzero(mask)
                            la = logp_np[i, allowed]
                            logz = float(np.logaddexp.reduce(la))
                            if log_threshold is not None:
                                keep = (la - logz >= log_threshold) | (allowed == t)
                                allowed, la = allowed[keep], la[keep]
                            if allowed_max_stored is not None and len(allowed) > \
                                    allowed_max_stored:
                                keep = np.zeros(len(allowed), dtype=bool)
                                keep[np.argsort(-la, kind="stable")[:allowed_max_stored]] = True
                                keep |= allowed == t
                                allowed, la = allowed[keep], la[keep]
                            try:
                                st.advance(t)
                            except ForbiddenTokenError:
                                in_grammar[i] = False  # mask and advance disagree: cut here
                                cut[i] = step
                            else:
                                rows.append((base + i, step, sid, t, float(logp_np[i, t]), logz))
                                allowed_ids.append(allowed.astype(np.int32))
                                allowed_lps.append(la.astype(np.float32))
                        else:
                            in_grammar[i] = False
                            cut[i] = step
                    if t in eos:
                        finished[i] = True
                if finished.all():
                    break
                nxt[torch.from_numpy(finished)] = pad
                out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True,
                            attention_mask=attention[:, : prompt_ids.shape[1] + step + 1])
                past, logits = out.past_key_values, out.logits[:, -1, :]
        for i in range(b):
            comp_tokens.append(toks[i])
            comp_lps.append(lps[i])
            cut_steps.append(cut[i])
            masker_done.append(bool(mstates[i].is_finished and in_grammar[i]))
        done_total += b
        bar.update(b)
    bar.close()
    sample_seconds = time.perf_counter() - t0

    n = n_samples
    truncated = np.array([not (t and t[-1] in eos) for t in comp_tokens], dtype=bool)
    texts = [masker.decode([x for x in t if x not in eos]) for t in comp_tokens]
    ref = np.array([acceptor.accepts(s) for s in texts], dtype=bool)
    masker_complete = np.array(masker_done, dtype=bool)
    valid = ref & masker_complete & ~truncated
    row_arr = np.array(rows, dtype=np.float64).reshape(-1, 6)
    row_comp = row_arr[:, 0].astype(np.int32)
    c_ids, c_off = _ragged(comp_tokens, np.int32)
    c_lps, _ = _ragged(comp_lps, np.float32)
    a_ids, a_off = _ragged(allowed_ids, np.int32)
    a_lps, _ = _ragged(allowed_lps, np.float32)
    manifest = {
        "prompt": prompt,
        "n_samples": n,
        "n_rows": len(rows),
        "n_states": len(states),
        "valid_fraction": float(valid.mean()),
        "truncated": int(truncated.sum()),
        "masker_rejected_valid": int((ref & ~truncated & ~masker_complete).sum()),
        "masker_accepted_invalid": int((masker_complete & ~ref).sum()),
        "sampling": {"proposal": proposal, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                     "seed": seed,
                     "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                     "allowed_min_prob": allowed_min_prob,
                     "allowed_max_stored": allowed_max_stored},
        "sample_seconds": sample_seconds,
        "grammar_name": masker.grammar.name,
        "eos_token_ids": sorted(eos),
        **masker.fingerprint(),
        **lm_fingerprint(lm),
        "feature_status": {k: _status_value(masker.feature_status.get(k)) for k in FEATURE_NAMES},
    }
    return TrainingData(
        completion_offsets=c_off, completion_token_ids=c_ids, completion_token_logprobs=c_lps,
        valid=valid, reference_accepts=ref, masker_complete=masker_complete,
        truncated=truncated, cut_step=np.array(cut_steps, dtype=np.int32), texts=texts,
        states=states, row_completion=row_comp,
        row_step=row_arr[:, 1].astype(np.int32), row_state=row_arr[:, 2].astype(np.int32),
        row_token=row_arr[:, 3].astype(np.int32),
        row_lm_logprob=row_arr[:, 4].astype(np.float32),
        row_log_z=row_arr[:, 5].astype(np.float32),
        row_label=valid[row_comp].astype(np.float32),
        allowed_offsets=a_off, allowed_token_ids=a_ids, allowed_lm_logprobs=a_lps,
        manifest=manifest)


def _status_value(status) -> str:
    return "missing" if status is None else str(getattr(status, "value", status))
