"""Wrapping what users already run, so that adopting SHIM is a one-line change.

A wrapper keeps the user's own constrained-decoding machinery (a plain ``model.generate`` call
here; XGrammar's, SynCode's and outlines' processors in the plugins' ``wrap`` modules) and adds
SHIM's ``β·log γ̂`` to the tokens it allows. All wrappers share :class:`ShimWrapper`, which adds
what a bare processor cannot check by itself:

- one :class:`MaskerState` per batch row, created at the first call (the batch size is only
  known then), dropped by :meth:`ShimWrapper.reset` between ``generate`` calls;
- every call, each row's tokens must continue the tokens its state consumed, one new token per
  call. Beam search, contrastive search and assisted decoding reorder or rewrite rows; the
  wrapper refuses them with :class:`UnsupportedDecodingError` instead of scoring a row with
  another row's state;
- a backend processor may never allow a token the controller's masker forbids
  (:class:`BackendDisagreementError`): it means the processor compiled another grammar or
  tokenizer than the controller was fitted for, or stopped constraining. One exception:
  control/special tokens (``<|im_start|>``, ``<unk>``...; EOS excluded), which some backends
  let through wherever their literal text would fit, are masked with one :class:`ShimWarning`
  naming them (they are never emitted as text). Likewise byte tokens that would make the
  output invalid UTF-8 for ever (outlines reads partial-UTF-8 tokens as U+FFFD, SynCode's byte
  DFAs pass unknown bytes in strings); partial-UTF-8 tokens that can still complete a character
  are allowed by the plugins' maskers. Tokens the backend forbids stay forbidden, so
  the backend's own guarantee is kept, and a row left with no token fails closed
  (:class:`~shim_adapters.errors.DeadEndError`).

Controllers are accepted only with their manifest (an artefact directory, the
``(controller, manifest)`` pair :func:`~shim_adapters.shim.fitting.fit_controller` returns, or a
controller plus ``manifest=``); :func:`bind_controller` checks it against the wrapper's masker
with :func:`~shim_adapters.shim.artefact.check_manifest`, so a controller fitted for backend A is
refused by a wrapper of backend B.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Tuple, Union

import torch

from shim_adapters.errors import (
    DeadEndError,
    ManifestMismatchError,
    ShimError,
    VocabMismatchError,
)
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.lm.generation import MaskedLogitsProcessor
from shim_adapters.lm.loading import _WEIGHT_SUFFIXES, files_digest
from shim_adapters.mask.bitmask import bitmask_to_bool
from shim_adapters.mask.protocol import Masker, MaskerState
from shim_adapters.mask.utf8 import incomplete_tail, utf8_prefix_ok
from shim_adapters.mask.vocab import Vocabulary
from shim_adapters.shim.artefact import (
    check_manifest,
    fitted_grammar,
    load_controller,
    read_manifest,
    warn_outside_fit,
)
from shim_adapters.shim.controller import Controller
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.prompt_set import FittedPrompts

#: What wrappers accept as a controller: an artefact directory, ``(controller, manifest)`` as
#: :func:`~shim_adapters.shim.fitting.fit_controller` returns it, or a fitted controller (then
#: pass ``manifest=``).
ControllerLike = Union[str, os.PathLike, Tuple[Controller, Mapping[str, Any]], Controller]

#: A backend processor as the wrapper calls it: (input_ids, scores) -> processed scores.
BackendCall = Callable[[torch.LongTensor, torch.FloatTensor], torch.FloatTensor]


class UnsupportedDecodingError(ShimError):
    """The decoding strategy reorders or rewrites rows (beam search, assisted decoding...)."""


class BackendDisagreementError(ShimError):
    """The wrapped processor allows a token the controller's masker forbids."""


@dataclass(frozen=True)
class IncompleteSample:
    """A row that stopped (``max_new_tokens``) before the grammar accepted: not an output.

    Wrappers return it in place of the row's text, so a cut-off sample is never passed off as
    grammatical output; ``text`` is what was generated, for inspection."""

    row: int
    text: str
    token_ids: tuple[int, ...]
    reason: str

    def __str__(self) -> str:
        return f"<incomplete sample, row {self.row}: {self.reason}; text {self.text!r}>"


class ShimWarning(UserWarning):
    """A wrapper corrected something the wrapped processor did (e.g. masked a control token)."""


# ---- controllers and their manifests ---------------------------------------------------------
def controller_manifest(controller: ControllerLike,
                        manifest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest that says what ``controller`` was fitted for (read, not yet checked)."""
    if manifest is not None:
        return dict(manifest)
    if isinstance(controller, (str, os.PathLike)):
        return read_manifest(controller)
    if isinstance(controller, tuple) and len(controller) == 2:
        return dict(controller[1])
    raise ValueError(f"a bare {type(controller).__name__} carries no manifest, so the wrapper "
                     "cannot check that it was fitted for this backend, grammar and tokenizer: "
                     "pass the artefact directory, the (controller, manifest) pair "
                     "fit_controller returns, or manifest=")


def grammar_of_manifest(manifest: Mapping[str, Any], grammar: Grammar | None = None) -> Grammar:
    """``grammar`` if given, else the grammar the controller was fitted on
    (:func:`~shim_adapters.shim.artefact.fitted_grammar`).

    Whichever it is, :func:`bind_controller` later checks its sha256 against the manifest.
    """
    return grammar if grammar is not None else fitted_grammar(manifest)


def bind_controller(controller: ControllerLike, masker: Masker, *,
                    manifest: Mapping[str, Any] | None = None, lm=None) -> Controller:
    """The fitted controller, after checking its manifest against ``masker`` (and ``lm``).

    Raises :class:`~shim_adapters.errors.ManifestMismatchError` naming the first field that
    differs (backend first: a controller fitted for another backend is refused).
    """
    if isinstance(controller, (str, os.PathLike)):
        if manifest is not None:
            raise ValueError("an artefact directory carries its own manifest; do not pass "
                             "manifest= with it")
        loaded, _ = load_controller(Path(controller), masker, lm)
        return loaded
    found = controller_manifest(controller, manifest)
    fitted = controller[0] if isinstance(controller, tuple) else controller
    if not isinstance(fitted, Controller):
        raise TypeError(f"expected a fitted Controller, got {type(fitted).__name__}")
    check_manifest(found, masker, lm, "<controller manifest>")
    fitted.fitted_prompts_ = FittedPrompts.from_manifest(found)  # what _begin compares with
    return fitted


def check_model(manifest: Mapping[str, Any], model, lm=None,
                where: str = "<controller manifest>") -> None:
    """Refuse a controller fitted with another LM than ``model``, the one the wrapper runs.

    With ``lm`` (a :class:`~shim_adapters.lm.loading.LoadedLM`, whose identifier and revision
    :func:`bind_controller` checks) ``lm.model`` must be ``model`` itself. Without it the
    revision is recomputed as :func:`~shim_adapters.lm.loading.load_lm` computes it, a sha256 over the
    weights files in the model's directory (``config._name_or_path``); a model loaded from
    elsewhere cannot be identified, so it is refused until ``lm=`` is passed.
    """
    if lm is not None:
        if getattr(lm, "model", None) is not model:
            raise ValueError(f"lm= ({getattr(lm, 'identifier', lm)!r}) is not the model the "
                             f"wrapper runs ({type(model).__name__} from "
                             f"{getattr(getattr(model, 'config', None), '_name_or_path', '?')!r})")
        return
    revision = manifest.get("lm_revision")
    if revision is None:
        return  # the controller was fitted without recording its LM

    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    directory = Path(source)
    weights = (sorted(p for p in directory.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
               if source and directory.is_dir() else [])
    if not weights:
        raise ShimError(f"cannot tell which LM the wrapper runs ({source!r} is no local model "
                        f"directory with weights), so it cannot check it is the one the "
                        f"controller was fitted with ({manifest.get('lm_identifier')!r}): pass "
                        f"lm=load_lm(...)")
    found = files_digest(weights)
    if found != revision:
        raise ManifestMismatchError("lm_revision", found, revision, where)


# ---- the shared wrapper ----------------------------------------------------------------------
class ShimWrapper(MaskedLogitsProcessor):
    """A ``LogitsProcessor``: optional backend processor, then SHIM over its allowed tokens.

    Without a backend (``backend=None``) the masker's states do the masking: this is what
    :func:`shim_logits_processor` returns. Subclasses (the plugins' wrappers) pass the user's
    processor as ``backend`` and may override :meth:`_create_states` / :meth:`_consume` to read
    features from the backend's own per-row state.
    """

    #: Whether the backend's allowed set is compared with the masker's on the whole logits
    #: (a wrapper whose states read the backend's own mask overrides :meth:`_agree` with a
    #: check in the packed domain and sets this False).
    dense_agreement = True

    def __init__(self, masker: Masker, controller: Controller, *,
                 batch_size: int | None = None, backend: BackendCall | None = None):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        # MaskedLogitsProcessor.__init__ wants the states up front; these are made at the first
        # call, so its attributes (states, adjuster, _prompt_length) are set here instead.
        self.masker = masker
        self.controller = controller
        self.adjuster = ShimAdjuster(controller)
        self.batch_size = batch_size
        self.backend = backend
        self.states: list[MaskerState] = []
        self._prompt_length: int | None = None
        self._n_tokens = len(masker.tokenizer)  # len() of a fast tokenizer is not free
        self._bitmask = None
        self._eos_row = None
        self._warned_special: set[int] = set()
        self._warned_utf8: set[int] = set()
        self._last_ids: torch.LongTensor | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def reset(self, states: Sequence[MaskerState] | None = None) -> None:
        """Forget every row: the next call starts a new ``generate`` (new batch, new prompt)."""
        if states is not None:
            raise TypeError(f"{type(self).__name__} creates its own states at the first call; "
                            "reset() takes no arguments")
        self.states = []
        self._prompt_length = None
        self._last_ids = None
        self._reset_backend()

    def _reset_backend(self) -> None:
        """Hook: reset the wrapped processor."""

    def _create_states(self, rows: int) -> list[MaskerState]:
        """Hook: one fresh state per row, after the backend's first call."""
        return [self.masker.new_state() for _ in range(rows)]

    def _consume(self, row: int, state: MaskerState, token_id: int) -> None:
        """Hook: make ``state`` consume the row's new token (after the backend's call)."""
        state.advance(token_id)

    def _consume_all(self, new: Sequence[int | None]) -> None:
        """Every live row consumes its new token (None: a finished row): one batched
        ``advance_states`` unless a wrapper overrides :meth:`_consume`."""
        if type(self)._consume is ShimWrapper._consume and self.states:
            live = [(state, token) for state, token in zip(self.states, new)
                    if token is not None]
            if live:
                self.masker.advance_states([s for s, _ in live], [t for _, t in live])
            return
        for row, (state, token) in enumerate(zip(self.states, new)):
            if token is not None:
                self._consume(row, state, token)

    # ---- row bookkeeping ----------------------------------------------------------------
    def _begin(self, input_ids: torch.LongTensor) -> None:
        rows = int(input_ids.shape[0])
        if self.batch_size is not None and rows != self.batch_size:
            raise UnsupportedDecodingError(
                f"the first call has {rows} rows but the wrapper was made for batch_size="
                f"{self.batch_size}: beam search (num_beams>1) is not supported, and "
                f"num_return_sequences must be counted in batch_size (prompts x samples)")
        self._warn_prompts_outside_fit(input_ids)

    def _warn_prompts_outside_fit(self, input_ids: torch.LongTensor) -> None:
        """A warning (never an error) naming the rows whose prompt, as token ids, is none of
        those the controller was fitted on; left padding is not part of a prompt."""
        fitted = getattr(self.controller, "fitted_prompts_", None)
        if fitted is None or fitted.ids_sha256 is None:
            return  # the manifest records no prompt ids: nothing to compare with
        pad = getattr(self.masker.tokenizer, "pad_token_id", None)
        outside = []
        for row, ids in enumerate(input_ids.tolist()):
            start = 0
            while pad is not None and start < len(ids) and ids[start] == pad:
                start += 1
            # a pad id that is also the prompt's first token (pad = BOS) may start the prompt
            if not any(fitted.has_ids(ids[k:]) for k in range(start, max(0, start - 1) - 1, -1)):
                outside.append(row)
        if outside:
            rows = ", ".join(map(str, outside[:8])) + (" ..." if len(outside) > 8 else "")
            warn_outside_fit(fitted, type(self).__name__,
                             f"the prompt of row(s) {rows}", stacklevel=5)

    def _new_tokens(self, input_ids: torch.LongTensor) -> list[int | None]:
        """Each live row's single new token, after checking it continues the row's history.

        The usual case costs one comparison: every row is the previous call's ids plus one
        token. Anything else takes the row-by-row check, which names the row that broke."""
        last = getattr(self, "_last_ids", None)
        if (last is not None and input_ids.shape[0] == last.shape[0]
                and input_ids.shape[1] == last.shape[1] + 1
                and torch.equal(input_ids[:, :-1], last)):
            tokens = input_ids[:, -1].tolist()
            return [None if state.is_finished else int(token)
                    for state, token in zip(self.states, tokens)]
        return self._new_tokens_checked(input_ids)

    def _new_tokens_checked(self, input_ids: torch.LongTensor) -> list[int | None]:
        if input_ids.shape[0] != len(self.states):
            raise UnsupportedDecodingError(
                f"the batch has {input_ids.shape[0]} rows but the wrapper holds "
                f"{len(self.states)} row states (did the batch change without reset()? beam "
                f"search is not supported)")
        generated = input_ids[:, self._prompt_length:].tolist()
        out: list[int | None] = []
        for row, (state, tokens) in enumerate(zip(self.states, generated)):
            history = list(state.token_ids)
            if tokens[:len(history)] != history:
                raise UnsupportedDecodingError(
                    f"row {row} no longer continues the tokens its state consumed (rows were "
                    f"reordered or rewritten: beam search, contrastive search and assisted "
                    f"decoding are not supported; or reset() was not called between generate "
                    f"calls); state: {state.describe()}")
            if state.is_finished:
                out.append(None)  # transformers pads finished rows
                continue
            if len(tokens) != len(history) + 1:
                raise UnsupportedDecodingError(
                    f"row {row} gained {len(tokens) - len(history)} tokens since the last call; "
                    f"the wrapper needs exactly one per call (assisted or speculative decoding "
                    f"is not supported; or reset() was not called between generate calls); "
                    f"state: {state.describe()}")
            out.append(int(tokens[-1]))
        return out

    # ---- results ------------------------------------------------------------------------
    def outputs(self, sequences: torch.LongTensor) -> list[Union[str, IncompleteSample]]:
        """The last ``generate`` call's outputs, one per row: the text of a row that ended in
        EOS (or whose text the grammar accepts), an :class:`IncompleteSample` otherwise.

        ``sequences``: what ``generate`` returned (prompt + generated ids). The tokens the
        processor never saw (each row's last one) are fed to forks of the row states, so a
        token the grammar forbids still raises."""
        if self._prompt_length is None:
            raise ValueError("the wrapper has not been called yet: run generate first")
        if sequences.shape[0] != len(self.states):
            raise ValueError(f"{sequences.shape[0]} sequences for {len(self.states)} rows")
        eos = set(self.masker.eos_token_ids)
        out: list[Union[str, IncompleteSample]] = []
        for row, (state, tokens) in enumerate(zip(self.states,
                                                  sequences[:, self._prompt_length:].tolist())):
            history = len(state.token_ids)
            if tokens[:history] != list(state.token_ids):
                raise UnsupportedDecodingError(f"row {row}: the sequences do not continue the "
                                               f"tokens its state consumed")
            final = state.fork()
            for token in tokens[history:]:
                if final.is_finished:
                    break  # transformers pads finished rows
                final.advance(token)
            ids = tuple(t for t in final.token_ids if t not in eos)
            text = self.masker.decode(ids)
            if final.is_finished or final.eos_allowed():
                out.append(text)
            else:
                out.append(IncompleteSample(
                    row=row, text=text, token_ids=ids,
                    reason=f"stopped after {len(ids)} tokens before the grammar accepted "
                           f"(max_new_tokens reached?); state: {final.describe()}"))
        return out

    def incomplete_rows(self, sequences: torch.LongTensor) -> list[int]:
        """Rows of the last ``generate`` call that stopped before the grammar accepted."""
        return [i for i, o in enumerate(self.outputs(sequences))
                if isinstance(o, IncompleteSample)]

    # ---- the call -----------------------------------------------------------------------
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        first = self._prompt_length is None
        if first:
            self._begin(input_ids)
        else:
            new = self._new_tokens(input_ids)
        width = self.masker.vocab_size
        if scores.shape[-1] != width:
            raise VocabMismatchError(f"model logits have width {scores.shape[-1]} but the masker "
                                     f"was compiled for {width}")
        self._last_ids = input_ids
        dense_check = self.backend is not None and self.dense_agreement
        was_neginf = torch.isneginf(scores) if dense_check else None
        if self.backend is not None:
            scores = self.backend(input_ids, scores)
        if first:
            self.states = self._create_states(int(input_ids.shape[0]))
            self._prompt_length = int(input_ids.shape[1])
        else:
            self._consume_all(new)
        bitmask = self.fill_bitmask()  # finished rows: EOS only; DeadEndError on an empty row
        if self.backend is not None:
            self._agree(bitmask, scores, was_neginf)
        elif self.adjuster is not None:  # γ, then the mask (as MaskedLogitsProcessor)
            if (type(self)._apply_mask is ShimWrapper._apply_mask
                    and self.adjuster.add_masked_log_gamma_(scores, self._live_states(),
                                                            self._live, bitmask)):
                return scores  # γ and the mask in one add (CPU, narrow vocabulary)
            self._apply_adjuster(scores, live=self._live)
            self._apply_mask(scores, bitmask)
            return scores
        self._apply_mask(scores, bitmask)
        if dense_check:
            self._check_not_empty(scores)
        if self.adjuster is not None:
            self._apply_adjuster(scores, live=self._live)
        return scores

    def _apply_mask(self, scores: torch.FloatTensor, bitmask: torch.Tensor) -> None:
        """Hook: mask ``scores`` with the masker's packed masks (a wrapper whose backend has
        already applied nearly the same mask may apply only the difference)."""
        self.masker.apply_token_bitmask_(scores, bitmask)

    def _special_ids(self) -> torch.Tensor:
        """Control tokens of the tokenizer (EOS excluded): never output text."""
        cached = getattr(self, "_special_cache", None)
        if cached is None:
            tok = self.masker.tokenizer
            ids = set(getattr(tok, "all_special_ids", ())) | {
                i for i, t in getattr(tok, "added_tokens_decoder", {}).items()
                if getattr(t, "special", False)}
            ids -= set(self.masker.eos_token_ids)
            cached = torch.zeros(self.masker.vocab_size, dtype=torch.bool)
            cached[sorted(i for i in ids if 0 <= i < self.masker.vocab_size)] = True
            self._special_cache = cached
        return cached

    def _agree(self, bitmask: torch.Tensor, scores: torch.FloatTensor,
               was_neginf: torch.Tensor) -> None:
        """Refuse tokens only the backend allows, except control tokens (masked, one warning).

        The backend's own -inf stay in ``scores``; applying ``bitmask`` afterwards intersects
        the two masks."""
        n_tokens = self._n_tokens
        ours = bitmask_to_bool(bitmask, self.masker.vocab_size).to(scores.device)
        extra = ~torch.isneginf(scores) & ~ours & ~was_neginf
        # ids past the tokenizer (logit padding) have no text: some backends leave them
        # unmasked; they are masked here and are no sign of another grammar
        extra[:, n_tokens:] = False
        for row, state in enumerate(self.states):
            if state.is_finished:
                extra[row] = False
        if not bool(extra.any()):
            return
        special = extra & self._special_ids().to(extra.device)
        if bool(special.any()):
            ids = sorted(set(torch.nonzero(special)[:, 1].tolist()))
            new = _first_time(self._warned_special, ids)
            if new:
                shown = ", ".join(f"{t} ({self.masker.token_text(t)!r})" for t in new[:8])
                warnings.warn(
                    f"the wrapped {self.masker.backend_name} processor allows control token(s) "
                    f"{shown} inside the output; they are masked (control tokens are never "
                    f"emitted as text)", ShimWarning, stacklevel=3)
            extra &= ~special
        if not bool(extra.any()):
            return
        self._mask_broken_utf8(extra)
        self._mask_known_overreach(extra)
        if not bool(extra.any()):
            return
        row = int(torch.nonzero(extra.any(dim=1))[0, 0])
        state = self.states[row]
        ids = torch.nonzero(extra[row])[:, 0].tolist()
        shown = ", ".join(f"{t} ({self.masker.token_text(t)!r})" for t in ids[:5])
        raise BackendDisagreementError(
            f"the wrapped {self.masker.backend_name} processor allows {len(ids)} "
            f"token(s) at step {state.step}, batch row {row}, that the controller's "
            f"grammar forbids: {shown}. The processor's grammar or tokenizer is not the "
            f"one the controller was fitted for (or the processor stopped constraining)"
            f"; refusing to continue. State: {state.describe()}")

    def _token_bytes(self) -> list:
        cached = getattr(self, "_bytes_cache", None)
        if cached is None:
            cached = Vocabulary(self.masker.tokenizer, self.masker.vocab_size).token_bytes
            self._bytes_cache = cached
        return cached

    def _mask_broken_utf8(self, extra: torch.Tensor) -> None:
        """Drop from ``extra`` (in place) the byte tokens that would make a row's output
        invalid UTF-8 for ever, with one :class:`ShimWarning` per token id.

        Backends that match grammars over strings let them through: outlines' vocabulary
        reads every partial-UTF-8 token as U+FFFD (one valid character), SynCode's byte DFAs
        pass unknown bytes inside a string. No continuation of such a row is text, so masking
        them keeps every valid output; what a backend allows beyond that is still refused."""
        table = self._token_bytes()
        verdicts = self.__dict__.setdefault("_utf8_verdicts", {})  # pending -> {token: ok}
        broken: list[int] = []
        for row in torch.nonzero(extra.any(dim=1))[:, 0].tolist():
            done = [table[t] for t in self.states[row].token_ids if t < len(table) and table[t]]
            pending = incomplete_tail(b"".join(done[-3:]))
            known = verdicts.setdefault(pending, {})
            row_broken = []
            for token_id in torch.nonzero(extra[row])[:, 0].tolist():
                ok = known.get(token_id)
                if ok is None:
                    data = table[token_id]
                    ok = known[token_id] = not data or utf8_prefix_ok(pending + data)
                if not ok:
                    row_broken.append(token_id)
            if row_broken:
                extra[row, row_broken] = False
                broken.extend(row_broken)
        new = _first_time(self._warned_utf8, broken)
        if new:
            shown = ", ".join(f"{t} ({table[t]!r})" for t in new[:8])
            warnings.warn(
                f"the wrapped {self.masker.backend_name} processor allows {len(new)} byte "
                f"token(s) where they make the output invalid UTF-8 for ever ({shown}"
                f"{', ...' if len(new) > 8 else ''}); they are masked",
                ShimWarning, stacklevel=4)

    def _mask_known_overreach(self, extra: torch.Tensor) -> None:
        """Hook: drop from ``extra`` (in place, with a warning) the tokens a documented bug of
        the wrapped processor lets through where the controller's masker is right."""

    def _check_not_empty(self, scores: torch.FloatTensor) -> None:
        empty = torch.isneginf(scores).all(dim=1)
        if bool(empty.any()):
            row = int(torch.nonzero(empty)[0, 0])
            state = self.states[row]
            raise DeadEndError(state.step, state.describe(), row=row)


def shim_logits_processor(masker: Masker, controller: ControllerLike,
                          batch_size: int | None = None, *,
                          manifest: Mapping[str, Any] | None = None, lm=None,
                          model=None) -> ShimWrapper:
    """A ``LogitsProcessor`` for ``model.generate(..., logits_processor=[...])``.

    Masks with ``masker`` (one state per row, created at the first call) and adds SHIM's
    correction. ``batch_size`` (prompts x num_return_sequences) makes a mismatch, e.g. beam
    search, fail at the first call; ``None`` takes the batch size from the first call. Call
    ``reset()`` between ``generate`` calls; ``outputs(sequences)`` reports rows cut off
    before the grammar accepted. ``model`` (the one ``generate`` runs) is checked against
    the LM the controller was fitted with (:func:`check_model`).
    """
    fitted = bind_controller(controller, masker, manifest=manifest, lm=lm)
    if model is not None:
        check_model(controller_manifest_of(controller, manifest), model, lm)
    return ShimWrapper(masker, fitted, batch_size=batch_size)


def controller_manifest_of(controller: ControllerLike,
                           manifest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`controller_manifest`, or ``{}`` for a bare controller (refused elsewhere)."""
    try:
        return controller_manifest(controller, manifest)
    except ValueError:
        return {}


def refuse_beam_search(inference_kwargs: Mapping[str, Any], model=None) -> None:
    """Raise UnsupportedDecodingError when ``generate`` would run beam search."""
    beams = inference_kwargs.get("num_beams")
    config = inference_kwargs.get("generation_config")
    if beams is None and config is not None:
        beams = getattr(config, "num_beams", None)
    if beams is None and model is not None:
        beams = getattr(getattr(model, "generation_config", None), "num_beams", None)
    if beams is not None and int(beams) > 1:
        raise UnsupportedDecodingError(
            f"num_beams={beams}: beam search reorders rows between steps, so per-row grammar "
            "states and SHIM's correction would follow the wrong rows; sample or decode greedily "
            "(num_beams=1)")
    if inference_kwargs.get("assistant_model") is not None or inference_kwargs.get(
            "prompt_lookup_num_tokens") is not None:
        raise UnsupportedDecodingError("assisted / prompt-lookup decoding proposes several tokens "
                                       "per step; the wrapper needs one token per row per call")


def _first_time(seen: set[int], token_ids) -> list[int]:
    """The ids not warned about yet (sorted), now marked as warned: one warning per token."""
    new = sorted(set(int(t) for t in token_ids) - seen)
    seen.update(new)
    return new
