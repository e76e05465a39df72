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

from shim_adapters.bitmask import numpy_first_empty_row
from shim_adapters.errors import DeadEndError
from shim_adapters.grammar import Grammar
from shim_adapters.wrap import (ControllerLike, ShimWarning, ShimWrapper, _first_time,
                                bind_controller, controller_manifest, grammar_of_manifest)

from .masker import _ITEM_FIX_ROWS, XGrammarMasker, XGrammarState, _numpy_view


class BorrowedMatcherState(XGrammarState):
    """An XGrammarState over a matcher that XGrammar's processor owns and advances."""

    def record(self, token_id: int) -> None:
        """Note a token the owning processor has already accepted into the matcher."""
        self._note_accepted(int(token_id))

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

    Each call, XGrammar's processor advances its matchers and fills its bitmask as usual, but
    its kernel masks a 32-column stand-in (:meth:`_call_inner`); the logits are masked with
    that same bitmask by the masker's kernel (:meth:`_apply_mask`: on CPU the core's, 1.1-5.6x
    cheaper than XGrammar's, and safe at widths that are not a multiple of 32, where
    XGrammar 0.2.9's CPU kernel writes past a row: docs/upstream-reports.md). The row states
    read XGrammar's bitmask in place, so the masker's mask is XGrammar's with the fix-up words
    (control tokens, padding, EOS) changed: the two are compared on those words of the packed
    masks, not on the whole logits."""

    dense_agreement = False

    def __init__(self, xgr_processor, masker: XGrammarMasker, controller, *,
                 batch_size: int | None = None):
        super().__init__(masker, controller, batch_size=batch_size, backend=self._call_inner)
        self.inner = xgr_processor
        self._compiled = list(xgr_processor.compiled_grammars)

    _stand_in: torch.Tensor | None = None

    def _call_inner(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                    ) -> torch.FloatTensor:
        """XGrammar's call on a (batch, 32) stand-in for the logits: its matchers accept and
        its bitmask is filled exactly as on the real logits (it reads only ``input_ids``), and
        :meth:`_apply_mask` masks the real logits with that bitmask. Returns ``scores``
        untouched."""
        stand_in = self._stand_in
        if (stand_in is None or stand_in.shape[0] != scores.shape[0]
                or stand_in.device != scores.device or stand_in.dtype != scores.dtype):
            stand_in = self._stand_in = torch.zeros((scores.shape[0], 32), dtype=scores.dtype,
                                                    device=scores.device)
        self.inner(input_ids, stand_in)
        return scores

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

    _copied = None  # a bitmask that already holds XGrammar's rows of this call (see _fill_raw)
    _theirs_of = None  # XGrammar's bitmask tensor, and its numpy view
    _theirs = None
    _extra = None  # (rows, token ids) XGrammar allowed and the masker forbids, or None

    def fill_bitmask(self) -> torch.Tensor:
        """XGrammar's own bitmask of this call, read in place (no copy, no second fill): the
        masker's mask is XGrammar's with the fix-up words (control tokens, padding, EOS)
        changed and the byte guards' tokens cleared (byte_guards.py), so only those are
        compared, giving ``_extra``, the (row, token) pairs XGrammar allowed that the masker
        forbids (masked by :meth:`_apply_mask`). Raises DeadEndError for a live row with no
        token left in the intersection."""
        theirs = self.inner.token_bitmask
        if self._theirs_of is not theirs:
            self._theirs, self._theirs_of = theirs.numpy(), theirs
        words = self._theirs
        masker = self.masker
        states = self.states
        live = [row for row, state in enumerate(states) if not state.is_finished]
        # EOS is the masker's where XGrammar allowed it and the matcher completes (the two
        # agree on every state measured; is_completed is asked only there)
        scalars = masker._fix_scalars
        extra = None
        if scalars is not None and len(live) <= _ITEM_FIX_ROWS:  # item reads beat slice ops
            eos_bits = masker._fix_eos_by_word
            for row in live:
                done = (any(int(words[row, w]) & bits for w, bits in masker._eos_words)
                        and states[row]._matcher.is_completed())
                for j, (w, keep) in enumerate(scalars):
                    bits = int(words[row, w])
                    ours = bits & keep
                    if done:
                        ours |= eos_bits.get(w, 0)
                    if bits & ~ours:
                        if extra is None:
                            extra = np.zeros((len(states), len(scalars)), dtype=np.int32)
                        extra[row, j] = bits & ~ours
        elif live:
            fix = masker._fix_words
            t = words[:, fix]
            ours = t & masker._fix_keep
            eos_rows = np.flatnonzero((t & masker._fix_eos).any(axis=1)).tolist()
            completed = [row for row in eos_rows if not states[row].is_finished
                         and states[row]._matcher.is_completed()]
            if completed:
                ours[completed] |= masker._fix_eos
            extra = t & ~ours
            if len(live) < len(states):
                extra[[row for row, state in enumerate(states) if state.is_finished]] = 0
            if not extra.any():
                extra = None
        pairs = [] if extra is None else [_set_bits(extra, masker._fix_words)]
        start = masker._guard_start
        guarded = masker._guard_start_clears or any(
            states[row]._guard_states is not start for row in live)
        for g, guard in enumerate(masker._guards if guarded else ()):  # XGrammar's holes
            by_state: dict[int, list[int]] = {}
            for row in live:
                by_state.setdefault(states[row]._guard_states[g], []).append(row)
            for state, rows in by_state.items():
                index, keep = guard.clear[state]
                if len(index):
                    hit = words[np.ix_(rows, index)] & ~keep
                    if hit.any():
                        local, ids = _set_bits(hit, index)
                        pairs.append((np.asarray(rows)[local], ids))
        self._extra = None if not pairs else (np.concatenate([p[0] for p in pairs]),
                                              np.concatenate([p[1] for p in pairs]))
        if len(live) == len(states):
            empty = numpy_first_empty_row(words, masker.vocab_size)
        else:
            empty = next((row for row in live if numpy_first_empty_row(
                words[row:row + 1], masker.vocab_size) is not None), None)
        if empty is None and self._extra is not None:  # rows left with the extra bits only
            rows, ids = self._extra
            for row in np.unique(rows).tolist():
                kept = _without(words[row:row + 1], ids[rows == row])
                if numpy_first_empty_row(kept, masker.vocab_size) is not None:
                    empty = row
                    break
        if empty is not None:
            state = states[empty]
            raise DeadEndError(state.step, state.describe(), row=empty)
        return theirs

    def _apply_mask(self, scores: torch.FloatTensor, bitmask: torch.Tensor) -> None:
        """XGrammar's bitmask of this call (``bitmask``, what its kernel would have applied),
        by the masker's kernel; then the masker's differences, the fix-up words (control
        tokens, padding, EOS) and finished rows (EOS only): the intersection of the two
        masks."""
        masker = self.masker
        masker.apply_token_bitmask_(scores, bitmask)
        finished = [row for row, state in enumerate(self.states) if state.is_finished]
        if finished:  # only EOS, as fill_bitmask's row (transformers pads these rows)
            eos = min(masker.eos_token_ids)
            view = _numpy_of(scores)
            if view is not None:  # numpy: a third of the cost of the torch index ops
                kept = view[finished, eos]
                view[finished] = -np.inf
                view[finished, eos] = kept
            else:
                rows = torch.tensor(finished, device=scores.device)
                kept = scores[rows, eos]
                scores[rows] = float("-inf")
                scores[rows, eos] = kept
        if self._extra is not None:
            rows, ids = self._extra
            keep = ids < scores.shape[-1]
            scores[torch.from_numpy(rows[keep]).to(scores.device),
                   torch.from_numpy(ids[keep]).to(scores.device)] = float("-inf")

    def _consume(self, row: int, state: BorrowedMatcherState, token_id: int) -> None:
        state.record(token_id)

    def _consume_all(self, new) -> None:
        """:meth:`BorrowedMatcherState.record` of every live row, without the per-row hook
        calls (per-row Python overhead is most of the wrapper's own cost at batch 16-32)."""
        for state, token in zip(self.states, new):
            if token is not None:
                state._note_accepted(token)

    def _agree(self, bitmask, scores, was_neginf) -> None:
        """Tokens XGrammar allowed that the masker's fix-ups forbid (``_extra``, from
        :meth:`fill_bitmask`): control tokens are masked with one warning, padding silently;
        anything else (EOS where XGrammar and the matcher's completion disagree) takes the
        whole-logits check, which refuses it."""
        if self._extra is None:
            return
        masker = self.masker
        rows, ids = self._extra
        special = masker._special_ids
        guarded: dict[int, list[int]] = {}  # guard -> the tokens it refuses here
        for r, t in zip(rows.tolist(), ids.tolist()):
            for g, guard in enumerate(masker._guards):
                if t in guard.refused[self.states[r]._guard_states[g]]:
                    guarded.setdefault(g, []).append(t)
        known = {t for refused in guarded.values() for t in refused} | {
            int(t) for t in ids.tolist() if t >= masker.tokenizer_size or t in special}
        if len(known) == len(set(ids.tolist())):
            new = [t for t in sorted(set(int(t) for t in ids if int(t) in special))
                   if t not in self._warned_special]
            if new:
                self._warned_special.update(new)
                shown = ", ".join(f"{t} ({masker.token_text(t)!r})" for t in new[:8])
                warnings.warn(
                    f"the wrapped xgrammar processor allows control token(s) {shown} inside "
                    f"the output; they are masked (control tokens are never emitted as text)",
                    ShimWarning, stacklevel=3)
            warned = self.__dict__.setdefault("_warned_guarded", {})
            for g, refused in guarded.items():
                guard = masker._guards[g]
                new = _first_time(warned.setdefault(g, set()), sorted(set(refused)))
                if new:
                    shown = ", ".join(f"{t} ({masker.token_text(t)!r})" for t in new[:8])
                    warnings.warn(
                        f"the wrapped xgrammar processor allows {len(new)} token(s) that "
                        f"{guard.why} ({shown}{', ...' if len(new) > 8 else ''}): an XGrammar "
                        f"{masker.backend_version} bug (docs/upstream-reports.md); they are "
                        f"masked", ShimWarning, stacklevel=3)
            return
        # a disagreement beyond these: the generic check names and refuses it (on a copy of
        # the logits masked as XGrammar's bitmask says: _call_inner left them unmasked)
        ours = _without(self._theirs, ids, rows)
        theirs = scores.clone()
        masker.apply_token_bitmask_(theirs, self._theirs_of)
        super()._agree(torch.from_numpy(ours), theirs,
                       torch.zeros_like(scores, dtype=torch.bool))


def _set_bits(words: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, token ids) of the set bits of ``words`` (n, k), whose column j is bitmask word
    ``index[j]``."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1,
                         bitorder="little").astype(bool)
    rows, cols = np.nonzero(bits)
    return rows, index[cols // 32] * 32 + cols % 32


def _without(words: np.ndarray, ids: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """A copy of the packed ``words`` with the bits of ``ids`` cleared (in ``rows[i]`` for
    ``ids[i]``; every row when ``rows`` is None)."""
    out = np.array(words, copy=True)
    view = out.view(np.uint32)
    ids = np.asarray(ids, dtype=np.int64)
    bits = (np.uint32(1) << (ids % 32).astype(np.uint32))
    if rows is None:
        for w, b in zip((ids // 32).tolist(), bits.tolist()):
            view[:, w] &= ~np.uint32(b)
    else:
        for r, w, b in zip(np.asarray(rows).tolist(), (ids // 32).tolist(), bits.tolist()):
            view[r, w] &= ~np.uint32(b)
    return out


def _numpy_of(scores: torch.Tensor) -> np.ndarray | None:
    """The logits' own memory as numpy (CPU, no grad, float32), else None."""
    if scores.device.type != "cpu" or scores.requires_grad or scores.dtype != torch.float32:
        return None
    return scores.numpy()


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
