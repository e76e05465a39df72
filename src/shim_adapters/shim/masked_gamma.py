"""β·log γ̂ and the mask summed into one float row per (γ entry, packed mask row).

Why: at a batch, SHIM's correction and the mask are otherwise two passes over the logits (the
γ rows' gather-add, then ``masked_fill_`` with a stack of cached bool rows), and inside
``generate`` each pass runs with the caches cold after the LM's forward pass. A row's γ entry
and its packed mask determine their sum exactly (-inf where the bit is clear, the entry's value
where it is set), and decoding revisits few (entry, mask) pairs, so the sum is cached and one
gather-add applies both (``benchmarks/gamma_mask_cost.md``, 'summed rows').

For batches only: at batch 1 the two passes are one torch call each, and the check below
cancels what the sum saves (:meth:`~shim_adapters.shim.correction.ShimAdjuster.add_masked_log_gamma_`).

Exact only for logits with no +inf or NaN: ``x + -inf`` is NaN there where ``masked_fill_``
writes -inf (and greedy decoding's argmax would pick a NaN), so the caller checks the batch's
maximum first and takes the two-pass path otherwise. Only for narrow vocabularies
(:data:`MAX_WIDTH`): a wide row costs more memory traffic than the bool mask it replaces.

Bounded: rows are charged their floats and key; when a batch's new rows could overflow the
bound the table starts over *before* that batch is looked up, never during it (a batch's slots
index the table it was looked up in; :meth:`MaskedGammaRows.info`).
"""

from __future__ import annotations

import numpy as np
import torch

from shim_adapters.mask.bitmask import numpy_view

#: Widest logits the summed rows are kept for (columns; 32 KiB of float32 per row).
MAX_WIDTH = 8192
#: Default memory bound of one width's rows (floats and keys).
DEFAULT_MAX_BYTES = 32 << 20
_KEY_OVERHEAD = 150  # dict slot, key tuple, bytes object header


class MaskedGammaRows:
    """Summed rows for logits ``width`` columns wide and masks of ``words_per_row`` int32
    words (XGrammar's layout): :meth:`add_` adds, for each batch row, its γ entry's values
    (none for a row without correction) and -inf where its mask forbids.

    A row is keyed on the entry's encoded state (``GammaEntry.ekey``, which determines its
    values: the γ cache shares one entry per encoding) and the mask's bytes, so it stays valid
    when the γ cache evicts the entry and computes it again, and holds no entry (whose row
    view would keep a reallocated γ table alive)."""

    def __init__(self, width: int, words_per_row: int, max_bytes: int = DEFAULT_MAX_BYTES):
        if not 1 <= width <= words_per_row * 32:
            raise ValueError(f"{words_per_row} words per row cannot hold {width} tokens")
        self.width = int(width)
        self.words_per_row = int(words_per_row)
        self.max_bytes = int(max_bytes)
        self._row_bytes = 4 * self.width + 4 * self.words_per_row + _KEY_OVERHEAD
        self._reset()
        self.hits = self.misses = self.resets = 0

    def _reset(self) -> None:
        self._index: dict[tuple, int] = {}
        self._table = np.empty((8, self.width), dtype=np.float32)

    def add_(self, scores: torch.Tensor, words: np.ndarray, entries,
             gamma_table: np.ndarray) -> None:
        """``scores[r] += row(entries[r], words[r])`` for every row ``r`` of a batch of CPU
        float32 ``scores`` (``entries[r]``: a :class:`~shim_adapters.shim.gamma_cache.GammaEntry`
        whose values are ``gamma_table[entry.slot]``, or None for mask only)."""
        step = 4 * self.words_per_row
        data = memoryview(words).cast("B")
        if self._index and (len(self._index) + len(entries)) * self._row_bytes > self.max_bytes:
            # start over now, not inside the loop: a reset there would leave the slots already
            # collected pointing into a table that is gone (an IndexError, or worse another
            # row's mask). A batch wider than the bound keeps its own rows for its call.
            self._reset()
            self.resets += 1
        index = self._index
        slots = []
        for r, entry in enumerate(entries):
            key = (None if entry is None else entry.ekey, data[r * step:(r + 1) * step].tobytes())
            i = index.get(key)
            if i is None:
                i = self._build(key, entry, gamma_table)
            else:
                self.hits += 1
            slots.append(i)
        # one numpy gather-add: cheaper inside generate than torch's index_select + add_
        # (benchmarks/gamma_mask_cost.md, 'batch-1 γ add')
        view = numpy_view(scores)
        view += self._table[slots]

    def _build(self, key: tuple, entry, gamma_table: np.ndarray) -> int:
        packed = key[1]
        if len(packed) != 4 * self.words_per_row:
            raise ValueError(f"a packed row of {self.words_per_row} words has "
                             f"{4 * self.words_per_row} bytes, got {len(packed)}")
        self.misses += 1
        i = len(self._index)
        if i == len(self._table):
            table = np.empty((2 * i, self.width), dtype=np.float32)
            table[:i] = self._table
            self._table = table
        row = self._table[i]
        row[:] = 0.0
        if entry is not None:
            values = gamma_table[entry.slot]
            span = min(len(values), self.width)
            row[:span] = values[:span]
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=self.width,
                             bitorder="little")
        row[bits == 0] = -np.inf
        self._index[key] = i
        return i

    def info(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {"rows": len(self._index), "bytes": len(self._index) * self._row_bytes,
                "hits": self.hits, "misses": self.misses, "resets": self.resets,
                "hit_rate": self.hits / lookups if lookups else 0.0}
