"""SHIM at decoding time: add β·log γ̂ to the masked logits of the allowed tokens.

:class:`ShimAdjuster` is a :class:`~shim_adapters.lm.generation.LogitAdjuster`: per step and row
it reads the masker state's features once, computes the state part of the controller once,
and scores every allowed token with one vectorised gather (all rows share one call of the
controller's head). :class:`~shim_adapters.lm.generation.MaskedLogitsProcessor` masks after
adding the values, so a forbidden token ends at -inf whatever was added: the masker's
guarantee is untouched.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from shim_adapters.lm.generation import (
    MaskedGeneration,
    MaskedLogitsProcessor,
    masked_generation,
)
from shim_adapters.lm.prompting import prefill_prompt
from shim_adapters.lm.sampling import sample
from shim_adapters.lm.views import stop_folded
from shim_adapters.mask.bitmask import numpy_view
from shim_adapters.mask.protocol import Masker, MaskerState
from shim_adapters.shim.controller import Controller
from shim_adapters.shim.gamma_cache import DEFAULT_MAX_BYTES, shared_gamma_cache
from shim_adapters.shim.prompt_set import warn_outside_fit

_NUMPY_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: Batches from this many rows take the summed γ + mask rows (see add_masked_log_gamma_).
_SUMMED_MIN_ROWS = 2


class ShimAdjuster:
    """log γ̂ (damped by the controller's β) for the allowed tokens of each row.

    Two entry points: :meth:`log_gamma` (values for given allowed ids; evaluation scores with
    it) and :meth:`add_log_gamma_` (the decoding hot path: in place on a batch of masked logits,
    through a :class:`~shim_adapters.shim.gamma_cache.GammaCache` keyed on each state's
    :meth:`~shim_adapters.mask.protocol.MaskerState.feature_key`)."""

    def __init__(self, controller: Controller, damped: bool = True,
                 cache_bytes: int = DEFAULT_MAX_BYTES):
        if not hasattr(controller, "weights_"):
            raise ValueError(f"{type(controller).__name__} is not fitted: call fit() or load "
                             f"an artefact first")
        self.controller = controller
        self.damped = damped
        #: shared by every adjuster of this controller: warm across generate calls
        self.cache = shared_gamma_cache(controller, damped=damped, max_bytes=cache_bytes)
        self._index: dict[torch.device, torch.Tensor] = {}
        self._widened: set[int] = set()  # logits widths the cache was asked to widen to
        #: True when the correction adds nothing: damped by β = 0 (the fit chose plain
        #: masking, e.g. where the controller did not beat it on held-out data). The adjuster
        #: then leaves the logits to the mask alone instead of adding zeros every step. Fixed
        #: here, as the cache's values are; a plain attribute, since the processors read it
        #: every step (benchmarks/gamma_mask_cost.md, 'hit-path trims')
        self.inert: bool = bool(damped and controller.beta_ == 0.0)

    def log_gamma(self, states: Sequence[MaskerState],
                  allowed: Sequence[np.ndarray]) -> list[np.ndarray]:
        return self.controller.predict_log_gamma_batch([s.features() for s in states], allowed,
                                                       damped=self.damped)

    def _scored_index(self, device: torch.device) -> torch.Tensor:
        """The token id of each γ-cache table column, on ``device``."""
        index = self._index.get(device)
        if index is None or len(index) != len(self.cache.columns):  # new, or the cache widened
            index = self._index[device] = torch.from_numpy(self.cache.columns).to(device)
        return index

    def add_log_gamma_(self, scores: torch.Tensor, states: Sequence[MaskerState],
                       rows: Sequence[int] | None = None, *, exact: bool = False
                       ) -> torch.Tensor:
        """Add β·log γ̂ to ``scores[rows[i]]`` for ``states[i]``, in place; returns ``scores``.

        ``scores``: (batch, vocab) logits, already masked (forbidden tokens at -inf stay -inf,
        so the masker's guarantee is untouched). ``rows``: the batch row of each state
        (default: row i for state i); other rows are left alone. With ``exact=False`` (the
        default) each row gets log γ̂ minus one per-row constant (the value shared by every
        token without features of its own), which the softmax removes: sampling and
        log-probabilities after ``log_softmax`` are exactly those of :meth:`log_gamma`, at the
        cost of one gather-add over the controller's known tokens instead of a dense add.
        ``exact=True`` adds the constant too (one more dense add)."""
        if self.inert:  # β = 0: every value is 0·log γ̂ (the shared one too), nothing to add
            if rows is not None and len(rows) != len(states):
                raise ValueError(f"{len(states)} states but {len(rows)} rows")
            return scores
        cache = self.cache
        shape = scores.shape  # read once: len() on a tensor is a Python call ('hit-path trims')
        if (len(states) == 1 and cache.dense and not exact and len(shape) == 2
                and scores.dtype is torch.float32 and scores.is_cpu):
            # batch 1: one torch add of the entry's row, as inside generate torch's kernels are
            # warm after the LM's forward pass and numpy's are not; batches take numpy's
            # gather-add below, cheaper there (benchmarks/gamma_mask_cost.md, 'batch-1 γ add').
            # The gather layout (50k+ vocabularies) takes numpy's fancy add below: index_add_
            # and put_ are faster alone but slower in context (same file, 'gather layout').
            if rows is not None and len(rows) != 1:
                raise ValueError(f"1 state but {len(rows)} rows")
            width = shape[1]
            if cache.width != width and width not in self._widened:
                cache.widen(width)  # once per width (it may decline: memory)
                self._widened.add(width)
            entry = cache.entry(states[0])
            row = 0 if rows is None else rows[0]
            target = scores if shape[0] == 1 and row == 0 else scores[row:row + 1]
            if cache.width != width:  # narrower than the logits: the scored span only
                target = target[:, :cache.width]
            target.add_(entry.row)
            return scores
        try:  # numpy on the logits' own memory (CPU, no grad): cheaper than torch here
            view = numpy_view(scores)  # the mask kernel reuses it
        except (TypeError, RuntimeError):
            view = None
        else:
            if view.dtype not in _NUMPY_DTYPES:
                view = None
            elif len(states) == 1 and view.ndim == 2 and not exact:  # batch 1: the hot path
                row = 0 if rows is None else rows[0]
                if rows is not None and len(rows) != 1:
                    raise ValueError(f"1 state but {len(rows)} rows")
                entry = cache.entry(states[0])
                if cache.dense:
                    target = view[row, :cache.width]
                    target += cache.table[entry.slot]
                else:
                    target = view[row]
                    target[cache.columns] += cache.table[entry.slot]
                return scores
        if (view.ndim if view is not None else scores.dim()) != 2:
            raise ValueError(f"scores must be (batch, vocab), got shape {tuple(scores.shape)}")
        if rows is None:
            rows = range(len(states))
        elif len(rows) != len(states):
            raise ValueError(f"{len(states)} states but {len(rows)} rows")
        if not len(states):
            return scores
        entries = cache.entries(states)
        if view is not None:
            # at these sizes a torch call costs more than the work: one add at batch 1, one
            # gather-add for a batch
            table = cache.table
            dense, width = cache.dense, cache.width  # dense: columns are token ids 0..width-1
            if len(entries) == 1:
                if dense:
                    target = view[rows[0], :width]
                    target += table[entries[0].slot]
                else:
                    row = view[rows[0]]
                    row[cache.columns] += table[entries[0].slot]
            else:
                values = table[[e.slot for e in entries]]
                if len(rows) == len(view) and (isinstance(rows, range) and rows.start == 0
                                               or all(r == i for i, r in enumerate(rows))):
                    if dense:
                        target = view[:, :width]
                        target += values
                    else:
                        view[:, cache.columns] += values
                elif dense:  # some rows (the others finished): rows gathered, one slice
                    view[np.asarray(rows, dtype=np.intp), :width] += values
                else:
                    view[np.ix_(np.asarray(rows, dtype=np.intp), cache.columns)] += values
            if exact:
                shared = np.array([e.shared for e in entries], dtype=view.dtype)
                view[np.asarray(rows, dtype=np.intp)] += shared[:, None]
            return scores
        batch = scores.shape[0]
        index = self._scored_index(scores.device)
        slots = torch.tensor([e.slot for e in entries], dtype=torch.long)
        values = cache.table_tensor.index_select(0, slots)
        if len(rows) != batch or any(r != i for i, r in enumerate(rows)):
            delta = torch.zeros((batch, len(index)), dtype=torch.float32)
            delta.index_copy_(0, torch.as_tensor(list(rows), dtype=torch.long), values)
            values = delta
        if values.device != scores.device or values.dtype != scores.dtype:
            values = values.to(device=scores.device, dtype=scores.dtype)
        scores.index_add_(1, index, values)
        if exact:
            shared = torch.zeros(batch, dtype=torch.float32)
            shared[torch.as_tensor(list(rows), dtype=torch.long)] = torch.tensor(
                [e.shared for e in entries], dtype=torch.float32)
            scores.add_(shared.to(device=scores.device, dtype=scores.dtype)[:, None])
        return scores

    def add_masked_log_gamma_(self, scores: torch.Tensor, states: Sequence[MaskerState],
                              rows: Sequence[int] | None, bitmask: torch.Tensor) -> bool:
        """:meth:`add_log_gamma_` and the packed ``bitmask``'s mask in one add of cached
        summed rows (:mod:`shim_adapters.shim.masked_gamma`); rows not in ``rows`` (None: every
        row) are masked only. True when done; False, with ``scores`` untouched, where the sum
        is not exact or does not pay: a non-finite logit, wide or non-float32 logits, a sparse
        γ table, batch 1 (there γ's add and the mask are one torch call each, and the check of
        the logits' maximum cancels what the sum saves: ``benchmarks/gamma_mask_cost.md``,
        'summed rows'). Then the caller adds γ and masks."""
        cache = self.cache
        shape = scores.shape
        if (self.inert or len(shape) != 2 or shape[0] < _SUMMED_MIN_ROWS or not cache.dense
                or not scores.is_cpu or scores.dtype is not torch.float32 or not bitmask.is_cpu
                or bitmask.dtype is not torch.int32 or bitmask.shape[0] != shape[0]
                or scores.requires_grad):
            return False
        masked = cache.masked_rows(shape[1], bitmask.shape[1])
        if masked is None or not float(scores.max()) < float("inf"):  # +inf or NaN: exact path
            return False
        entries = [cache.entry(states[0])] if len(states) == 1 else cache.entries(states)
        n_rows = shape[0]
        if rows is not None and len(rows) != n_rows:
            per_row = [None] * n_rows
            for r, entry in zip(rows, entries):
                per_row[r] = entry
            entries = per_row
        elif len(entries) != n_rows:
            raise ValueError(f"{len(states)} states for {n_rows} rows")
        masked.add_(scores, numpy_view(bitmask), entries, cache.table)
        return True

    def cache_info(self) -> dict[str, float]:
        """The γ cache's hit rates and memory (see :meth:`GammaCache.info`)."""
        return self.cache.info()


class ShimLogitsProcessor(MaskedLogitsProcessor):
    """A :class:`MaskedLogitsProcessor` that applies SHIM's correction."""

    def __init__(self, states: Sequence[MaskerState], controller: Controller):
        super().__init__(states, adjuster=ShimAdjuster(controller))


def sample_with_shim(lm, masker: Masker, controller: Controller | None, prompt: str,
                     num_samples: int, *, max_new_tokens: int = 128, seed: int | None = None,
                     chat: bool | None = None, stop_at_newline: bool | None = None,
                     batch_size: int = 64) -> MaskedGeneration:
    """Sample ``num_samples`` constrained completions, SHIM-corrected (plain masking when
    ``controller`` is None). ``lm`` is a :class:`shim_adapters.lm.loading.LoadedLM`. ``chat`` and
    ``stop_at_newline`` default to what the controller was fitted with (its manifest's
    ``training.prompting``), else False: the controller is only valid for the same LM view."""
    import torch


    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    prompts = getattr(controller, "fitted_prompts_", None)
    if prompts is not None and prompts.has_text(prompt) is False:
        warn_outside_fit(prompts, "sample_with_shim", "the prompt")
    fitted = getattr(controller, "prompting_", {}) or {}
    chat = bool(fitted.get("chat", False)) if chat is None else chat
    fold = bool(fitted.get("stop_at_newline", False)) if stop_at_newline is None \
        else stop_at_newline
    if fold:
        lm = stop_folded(lm, masker.eos_token_ids)
    adjuster = ShimAdjuster(controller) if controller is not None else None
    drawn = sample(prefill_prompt(lm, prompt, chat), num_samples, masker=masker,
                   adjuster=adjuster, max_new_tokens=max_new_tokens, batch_size=batch_size,
                   generator=None if seed is None else torch.Generator().manual_seed(seed))
    return masked_generation(drawn)
