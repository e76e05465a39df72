"""SHIM on top of XGrammar's own ``xgrammar.contrib.hf.LogitsProcessor``.

``with_shim(xgr_processor, controller, tokenizer=tok)`` returns a processor with the same call
signature: XGrammar still masks (its matchers, its bitmask), and SHIM adds β·log γ̂ to the
tokens XGrammar allows.

Where the features come from: the processor's *own* matchers. After XGrammar's call has
advanced them, each row's matcher is wrapped in a :class:`BorrowedMatcherState`, the plugin's
:class:`~shim_xgrammar.masker.XGrammarState` over a matcher it does not advance, so the features
are read by exactly the readout the controller was trained with, from the matcher that masks,
at no extra parsing cost. That readout names Earley items by rule id, and rule ids depend on the
compiled grammar, so the wrapper refuses a processor whose compiled grammar (printed form) or
tokenizer info differs from the masker's built from the controller's grammar.

XGrammar's processor is single-use (it keeps its matchers after ``generate``); ``reset()``
replaces it with a fresh one over the same compiled grammars.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from shim_adapters.grammar import Grammar
from shim_adapters.wrap import (ControllerLike, ShimWarning, ShimWrapper, bind_controller,
                                controller_manifest, grammar_of_manifest)

from .masker import XGrammarMasker, XGrammarState, _numpy_view


class BorrowedMatcherState(XGrammarState):
    """An XGrammarState over a matcher that XGrammar's processor owns and advances."""

    def record(self, token_id: int) -> None:
        """Note a token the owning processor has already accepted into the matcher."""
        self._token_ids.append(int(token_id))
        if self._node is not None:
            self._walk(int(token_id))
        if int(token_id) in self.masker.eos_token_ids:
            self._finished = True

    def borrow_bitmask(self, processor, row: int, wrapper=None) -> None:
        """Take this row's mask from the owning processor's bitmask (it filled it this call)
        instead of filling it a second time; ``wrapper``: the ShimXGrammarProcessor that has
        already copied every row of it into the bitmask being filled (one copy per call)."""
        self._processor, self._row, self._wrapper = processor, row, wrapper

    def _fill_raw(self, bitmask, row: int) -> None:
        processor = getattr(self, "_processor", None)
        if processor is None:
            return super()._fill_raw(bitmask, row)
        wrapper = self._wrapper
        if wrapper is not None and wrapper._copied is bitmask and row == self._row:
            return  # the wrapper copied XGrammar's rows into this bitmask already
        _numpy_view(bitmask)[row] = processor.token_bitmask.numpy()[self._row]

    def advance(self, token_id: int) -> None:
        raise TypeError("this state's matcher is advanced by XGrammar's processor; use "
                        "record(), or fork() for an independent state")


class ShimXGrammarProcessor(ShimWrapper):
    """XGrammar's processor, then SHIM over the tokens it allows.

    The row states read XGrammar's own bitmask (the one its call just applied), so the
    masker's mask is XGrammar's with the fix-up words (control tokens, padding, EOS) changed:
    the two are compared on those words of the packed masks, not on the whole logits."""

    dense_agreement = False

    def __init__(self, xgr_processor, masker: XGrammarMasker, controller, *,
                 batch_size: int | None = None):
        super().__init__(masker, controller, batch_size=batch_size, backend=self._call_inner)
        self.inner = xgr_processor
        self._compiled = list(xgr_processor.compiled_grammars)

    def _call_inner(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                    ) -> torch.FloatTensor:
        return self.inner(input_ids, scores)

    def _reset_backend(self) -> None:
        from xgrammar.contrib.hf import LogitsProcessor

        self.inner = LogitsProcessor(self._compiled if len(self._compiled) > 1
                                     else self._compiled[0])

    def _create_states(self, rows: int) -> list[BorrowedMatcherState]:
        matchers = self.inner.matchers
        if len(matchers) != rows:
            raise RuntimeError(f"XGrammar's processor holds {len(matchers)} matchers for "
                               f"{rows} rows")
        states = [BorrowedMatcherState(self.masker, m, [], False) for m in matchers]
        for row, state in enumerate(states):
            state.borrow_bitmask(self.inner, row, self)
        return states

    _copied = None  # the bitmask that holds XGrammar's rows of this call

    def fill_bitmask(self) -> torch.Tensor:
        """XGrammar's bitmask of this call in one copy, then the masker's fix-ups per row."""
        theirs = self.inner.token_bitmask
        if self._bitmask is None or self._bitmask.shape != theirs.shape:
            self._bitmask = torch.empty_like(theirs)
        self._bitmask.copy_(theirs)
        self._copied = self._bitmask
        try:
            return super().fill_bitmask()
        finally:
            self._copied = None

    def _apply_mask(self, scores: torch.FloatTensor, bitmask: torch.Tensor) -> None:
        """XGrammar's call has applied its own mask; the masker's differs only in the fix-up
        words (control tokens, padding, EOS) and, for finished rows, in being EOS only. So
        only those are masked here, instead of a second pass of the kernel over the batch:
        the result is the intersection of the two masks, as a full apply would give."""
        masker = self.masker
        fix = masker._fix_words
        extra = self._extra  # XGrammar's words & ~ours on the fix-up words (from _agree)
        finished = [row for row, state in enumerate(self.states) if state.is_finished]
        if finished:  # only EOS, as fill_bitmask's row (transformers pads these rows)
            extra[finished] = 0
            eos = min(masker.eos_token_ids)
            rows = torch.tensor(finished, device=scores.device)
            kept = scores[rows, eos]
            scores[rows] = float("-inf")
            scores[rows, eos] = kept
        if extra.any():
            bits = np.unpackbits(np.ascontiguousarray(extra).view(np.uint8), axis=1,
                                 bitorder="little").astype(bool)
            rows, cols = np.nonzero(bits)
            ids = fix[cols // 32] * 32 + cols % 32
            keep = ids < scores.shape[-1]
            scores[torch.from_numpy(rows[keep]).to(scores.device),
                   torch.from_numpy(ids[keep]).to(scores.device)] = float("-inf")

    def _consume(self, row: int, state: BorrowedMatcherState, token_id: int) -> None:
        state.record(token_id)

    def _agree(self, bitmask, scores, was_neginf) -> None:
        """Tokens XGrammar allowed that the masker's fix-ups forbid: control tokens are
        masked with one warning, padding silently; anything else (EOS where XGrammar and the
        matcher's completion disagree) takes the whole-logits check, which refuses it."""
        masker = self.masker
        fix = masker._fix_words
        theirs = self.inner.token_bitmask.numpy()[:, fix]
        extra = self._extra = theirs & ~bitmask.numpy()[:, fix]
        extra = extra.copy()
        for row, state in enumerate(self.states):
            if state.is_finished:
                extra[row] = 0
        if not extra.any():
            return
        bits = np.unpackbits(np.ascontiguousarray(extra).view(np.uint8), axis=1,
                             bitorder="little").astype(bool)
        rows, cols = np.nonzero(bits)
        ids = fix[cols // 32] * 32 + cols % 32
        special = masker._special_ids
        if all(t >= masker.tokenizer_size or int(t) in special for t in ids.tolist()):
            new = [t for t in sorted(set(int(t) for t in ids if int(t) in special))
                   if t not in self._warned_special]
            if new:
                self._warned_special.update(new)
                shown = ", ".join(f"{t} ({masker.token_text(t)!r})" for t in new[:8])
                warnings.warn(
                    f"the wrapped xgrammar processor allows control token(s) {shown} inside "
                    f"the output; they are masked (control tokens are never emitted as text)",
                    ShimWarning, stacklevel=3)
            return
        # a disagreement beyond control tokens: the generic check names and refuses it
        super()._agree(bitmask, scores, torch.zeros_like(scores, dtype=torch.bool))


def _check_same_compilation(xgr_processor, masker: XGrammarMasker) -> None:
    expected = str(masker.compiled.grammar)
    for i, compiled in enumerate(xgr_processor.compiled_grammars):
        if str(compiled.grammar) != expected:
            raise ValueError(
                f"compiled grammar #{i} of the XGrammar processor is not the grammar the "
                f"controller was fitted for ({masker.grammar.name!r}): its rules differ, so the "
                f"controller's features (Earley items by rule id) would not mean the same")
        info, mine = compiled.tokenizer_info, masker.compiled.tokenizer_info
        if (info.vocab_size != mine.vocab_size
                or sorted(info.stop_token_ids) != sorted(mine.stop_token_ids)
                or info.dump_metadata() != mine.dump_metadata()
                or list(info.decoded_vocab) != masker.decoded_vocab):
            raise ValueError(
                f"compiled grammar #{i} of the XGrammar processor was compiled for another "
                f"tokenizer (vocab_size {info.vocab_size}, stop ids {info.stop_token_ids}) than "
                f"the one given (vocab_size {mine.vocab_size}, stop ids {mine.stop_token_ids})")


def with_shim(xgr_processor, controller: ControllerLike, *, tokenizer,
              grammar: Grammar | None = None, manifest: Mapping[str, Any] | None = None, lm=None,
              batch_size: int | None = None) -> ShimXGrammarProcessor:
    """Wrap ``xgrammar.contrib.hf.LogitsProcessor`` so that SHIM re-weights its allowed tokens.

    ``tokenizer``: the Hugging Face tokenizer the processor's grammar was compiled for (XGrammar
    keeps only a ``TokenizerInfo``; the controller is keyed on the tokenizer's content hash).
    ``grammar``: the Grammar the controller was fitted on (default: the built-in its manifest
    names). ``batch_size`` (prompts x num_return_sequences) makes beam search fail at the first
    call; without it, at the first reordering of rows. Raises ManifestMismatchError for a
    controller fitted for another backend, grammar or tokenizer, and ValueError for a processor
    compiled from another grammar or tokenizer.
    """
    from xgrammar.contrib.hf import LogitsProcessor

    if not isinstance(xgr_processor, LogitsProcessor):
        raise TypeError(f"expected xgrammar.contrib.hf.LogitsProcessor, got "
                        f"{type(xgr_processor).__name__}")
    if xgr_processor.matchers:
        raise ValueError("this XGrammar processor has already been used by a generate call "
                         "(it is single-use); wrap a fresh one")
    found = controller_manifest(controller, manifest)
    info = xgr_processor.compiled_grammars[0].tokenizer_info
    masker = XGrammarMasker(grammar_of_manifest(found, grammar), tokenizer,
                            vocab_size=info.vocab_size, stop_token_ids=list(info.stop_token_ids),
                            **XGrammarMasker.feature_options(found))
    fitted = bind_controller(controller, masker, manifest=manifest, lm=lm)
    _check_same_compilation(xgr_processor, masker)
    if batch_size is None and len(xgr_processor.compiled_grammars) > 1:
        batch_size = len(xgr_processor.compiled_grammars)  # one grammar per row
    return ShimXGrammarProcessor(xgr_processor, masker, fitted, batch_size=batch_size)


__all__: Sequence[str] = ("BorrowedMatcherState", "ShimXGrammarProcessor", "with_shim")
