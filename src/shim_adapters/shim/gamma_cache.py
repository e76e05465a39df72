"""A bounded LRU cache of SHIM's β·log γ̂ per masker state.

Decoding revisits the same states (a grammar has few distinct parser configurations), so the
correction of a state is computed once and reused. Every entry's values live in one row
(*slot*) of a single float32 table, shaped ``(slots, len(scored_token_ids_))``, so a hit
costs the state's :meth:`~shim_adapters.mask.protocol.MaskerState.feature_key`, one dict lookup,
and its share of one batched add: :meth:`GammaCache.slots` gives a batch's slot numbers, and
the caller adds ``table[slots]`` at the controller's scored token ids with one
``index_add_`` (or one numpy fancy add at batch 1, where a torch call costs more than the
work). A row holds the whole vocabulary's correction relative to the value shared by every
token without features of its own (the form of
:meth:`~shim_adapters.shim.controller.Controller.state_log_gamma`), so a hit never depends on which
tokens are allowed.

Two levels: ``feature_key -> entry`` (cheap key, exact identity of the features), and, on a
miss there, ``encoded state -> entry`` (the state's feature columns after the encoder dropped
what training never saw), so states that differ only in features the controller ignores share
one entry and skip the model head.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from typing import Hashable, Sequence

import numpy as np
import torch

from shim_adapters.mask.protocol import MaskerState
from shim_adapters.shim.masked_gamma import MAX_WIDTH, MaskedGammaRows

#: Default bound on the memory of cached corrections.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: Bytes charged per key and per entry on top of their payload (dict slots, objects).
#: :meth:`GammaCache.widen` widens dense rows to any logits width up to this many columns.
WIDEN_COLUMNS = 8192
_KEY_OVERHEAD = 100
_ENTRY_OVERHEAD = 164 + 240  # the entry, its dict slots, its row view (tensor object)


class GammaEntry:
    """One state's correction: ``shared`` for tokens without features of their own, and
    ``table[slot][i] = value(scored_token_ids[i]) - shared``. ``alive`` turns False when the
    entry is evicted (its slot is then reused): keys still pointing at it count as misses."""

    __slots__ = ("slot", "shared", "ekey", "alive", "used", "row")

    def __init__(self, slot: int, shared: float, ekey: tuple[bytes, bytes], row: torch.Tensor):
        self.slot = slot
        self.shared = shared
        self.ekey = ekey
        self.alive = True
        self.used = False
        #: ``table_tensor[slot]`` (kept current when the table is reallocated): batch 1 adds
        #: it with one torch call
        self.row = row


class GammaCache:
    """LRU cache of β·log γ̂ per state for one fitted controller (see the module docstring)."""

    def __init__(self, controller, damped: bool = True, max_bytes: int = DEFAULT_MAX_BYTES,
                 dense: bool | None = None):
        """``dense``: the table layout (None: dense when the scored span is narrow, below);
        False forces one column per scored token, the layout of 50k+ vocabularies."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.controller = controller
        self.damped = damped
        self.max_bytes = int(max_bytes)
        groups = set(controller.encoder_.groups)
        #: LR_NT reads no state: one entry serves every step.
        self.state_free = not groups & {"state", "cross"}
        scored = np.asarray(controller.scored_token_ids_, dtype=np.int64)
        span = int(scored.max()) + 1 if len(scored) else 1
        #: Dense rows (token ids 0..width-1, one contiguous add) when that is not much wider
        #: than the scored tokens alone; else one value per scored token (a gather-add).
        self.dense = span <= max(4096, 4 * len(scored)) if dense is None else bool(dense)
        self.width = span if self.dense else len(scored)
        #: The token id of each table column.
        self.columns = np.arange(span, dtype=np.int64) if self.dense else scored
        self._scored = scored
        self._row_bytes = 4 * self.width
        #: Per masker fingerprint (two maskers may read one dump differently): key -> entry;
        #: ``_keys`` finds a masker's table (weakly: a wrapper's masker may come and go).
        self._by_identity: dict[tuple, dict[Hashable, GammaEntry]] = {}
        self._keys: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
        self._by_encoding: OrderedDict[tuple[bytes, bytes], GammaEntry] = OrderedDict()
        #: (weak masker, its key table) of the last lookup: a weak dict's get costs a
        #: weakref per call
        self._last_keys: tuple = (_dead_ref, None)
        self._n_keys = 0
        self._key_bytes = 0
        self._table = np.zeros((4, self.width), dtype=np.float32)
        self._table_t = torch.from_numpy(self._table)
        self._free: list[int] = list(range(3, -1, -1))
        self._constant: GammaEntry | None = None
        self._masked: dict[tuple[int, int], MaskedGammaRows] = {}
        self.lookups = self.encoding_hits = self.misses = 0

    # ---- lookup ----------------------------------------------------------------------------
    @property
    def table(self) -> np.ndarray:
        """``(slots, len(columns))`` float32: row ``entry.slot`` is an entry's values minus
        its shared value at the token ids :attr:`columns`. Reallocated when it grows: index
        it after lookups."""
        return self._table

    @property
    def table_tensor(self) -> torch.Tensor:
        """:attr:`table` as a CPU torch tensor (same memory)."""
        return self._table_t

    @property
    def entry_bytes(self) -> int:
        """Memory charged per entry (its table row and bookkeeping; keys are extra)."""
        return self._row_bytes + _ENTRY_OVERHEAD

    def entry(self, state: MaskerState) -> GammaEntry:
        """The correction at ``state`` (computed and stored on a miss): the batch-1 hot path."""
        ref, keys = self._last_keys
        if self.state_free or state.masker is not ref():
            return self.entries([state])[0]
        key = state.feature_key()
        hit = keys.get(key)
        self.lookups += 1
        if hit is not None and hit.alive:
            hit.used = True
            return hit
        hit = self._miss(keys, key, hit, state)
        self._bound([hit])
        return hit

    def entries(self, states: Sequence[MaskerState]) -> list[GammaEntry]:
        """The corrections at ``states`` (the hot path: one key and one lookup per state; a
        hit moves nothing: eviction is CLOCK on entries, keys go oldest inserted first)."""
        if self.state_free:
            return [self._constant_entry(s) for s in states]
        out = []
        append = out.append
        masker, keys = self._last_keys
        masker = masker()
        missed = False
        for state in states:
            if state.masker is not masker:
                masker = state.masker
                keys = self._keys.get(masker)
                if keys is None:
                    keys = self._keys[masker] = self._keys_for(masker)
                self._last_keys = (weakref.ref(masker), keys)
            key = state.feature_key()
            hit = keys.get(key)
            if hit is not None and hit.alive:
                hit.used = True  # second chance at eviction (CLOCK), cheaper than a move
                append(hit)
                continue
            missed = True
            append(self._miss(keys, key, hit, state))
        self.lookups += len(states)
        if missed:  # memory grows only on a miss (a new key or entry)
            self._bound(out)
        return out

    def _miss(self, keys: dict, key: Hashable, stale: GammaEntry | None,
              state: MaskerState) -> GammaEntry:
        if stale is None:
            self._n_keys += 1
            self._key_bytes += _size_of(key) + _KEY_OVERHEAD
        hit = keys[key] = self._lookup_encoded(state)
        self._by_encoding.move_to_end(hit.ekey)
        return hit

    def _bound(self, keep: Sequence[GammaEntry]) -> None:
        if len(self._by_encoding) > 1 and self._live_bytes() > self.max_bytes:
            self._evict(keep)

    def _keys_for(self, masker) -> "dict[Hashable, GammaEntry]":
        """The key table of maskers with ``masker``'s fingerprint (same grammar, tokenizer,
        width, backend version and feature readout read a state dump the same way), so a
        wrapper built afresh per ``generate`` call finds its keys warm."""
        try:
            identity = tuple(sorted(masker.fingerprint().items()))
        except Exception:  # a masker without a fingerprint: keys of its own
            identity = ("masker", id(masker))
        table = self._by_identity.get(identity)
        if table is None:
            table = self._by_identity[identity] = {}
        return table

    def _constant_entry(self, state: MaskerState) -> GammaEntry:
        if self._constant is None:
            shared, values = self.controller.state_log_gamma(state.features(), self.damped)
            self._constant = self._store((b"", b""), shared, values)
            self._by_encoding[(b"", b"")] = self._constant
            self.misses += 1
        self.lookups += 1
        return self._constant

    def _lookup_encoded(self, state: MaskerState) -> GammaEntry:
        controller = self.controller
        enc, state_pre = controller.encode_state(state.features())
        ekey = (enc.state_columns.tobytes(), enc.cross_keys.tobytes())
        hit = self._by_encoding.get(ekey)
        if hit is not None:
            self._by_encoding.move_to_end(ekey)
            self.encoding_hits += 1
            return hit
        self.misses += 1
        shared, values = controller.encoded_log_gamma(enc, state_pre, self.damped)
        entry = self._by_encoding[ekey] = self._store(ekey, shared, values)
        return entry

    def _store(self, ekey: tuple[bytes, bytes], shared: float, values: np.ndarray
               ) -> GammaEntry:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        if self.dense:
            row = self._table[slot]
            row[:] = 0.0
            row[self._scored] = values - shared
        else:
            self._table[slot] = values - shared
        return GammaEntry(slot, float(shared), ekey, self._table_t[slot])

    def _grow(self) -> None:
        old = self._table
        table = np.zeros((2 * len(old), self.width), dtype=np.float32)
        table[:len(old)] = old
        self._free.extend(range(len(table) - 1, len(old) - 1, -1))
        self._set_table(table)

    def _set_table(self, table: np.ndarray) -> None:
        """Install a reallocated table; every live entry's row view follows it."""
        self._table, self._table_t = table, torch.from_numpy(table)
        for entry in self._by_encoding.values():
            entry.row = self._table_t[entry.slot]

    def widen(self, width: int) -> None:
        """Dense rows as wide as the logits (zeros past the scored span: those tokens share
        the row's value), so batch 1 adds a row with one call instead of slicing the logits
        first. Only for a dense table, and only up to twice its width or
        :data:`WIDEN_COLUMNS` columns (memory)."""
        if (not self.dense or width <= self.width
                or width > max(2 * self.width, WIDEN_COLUMNS)):
            return
        table = np.zeros((len(self._table), width), dtype=np.float32)
        table[:, :self.width] = self._table
        self.width = width
        self.columns = np.arange(width, dtype=np.int64)
        self._row_bytes = 4 * width
        self._set_table(table)

    def _evict(self, keep: Sequence[GammaEntry]) -> None:
        """Oldest entries first, skipping once those hit since (CLOCK), until the memory
        bound holds (those of the current step stay); their keys are dropped when looked up
        again, the oldest inserted keys when keys alone exceed the bound. The table shrinks to
        the live slots when it is mostly free."""
        keep_ids = {id(e) for e in keep}
        encoding = self._by_encoding
        kept = []
        second_chances = len(encoding)
        while encoding and self._live_bytes() > self.max_bytes:
            ekey, entry = encoding.popitem(last=False)
            if id(entry) in keep_ids:
                kept.append((ekey, entry))
                continue
            if entry.used and second_chances > 0:  # hit since it was last looked at
                entry.used = False
                second_chances -= 1
                encoding[ekey] = entry
                continue
            entry.alive = False
            self._free.append(entry.slot)
        for ekey, entry in kept:
            encoding[ekey] = entry
        for keys in self._by_identity.values():
            while keys and self._live_bytes() > self.max_bytes:
                key, entry = next(iter(keys.items()))
                if id(entry) in keep_ids and entry.alive:
                    break
                del keys[key]
                self._n_keys -= 1
                self._key_bytes -= _size_of(key) + _KEY_OVERHEAD
        if len(self._free) > len(self._table) // 2 and len(self._table) > 4:
            self._compact()

    def _live_bytes(self) -> int:
        return len(self._by_encoding) * self.entry_bytes + self._key_bytes

    def _compact(self) -> None:
        """Move the live entries to a table just big enough for them."""
        live = list(self._by_encoding.values())
        size = max(4, 1 << max(0, len(live) - 1).bit_length())
        table = np.zeros((size, self.width), dtype=np.float32)
        for i, entry in enumerate(live):
            table[i] = self._table[entry.slot]
            entry.slot = i
        self._set_table(table)
        self._free = list(range(size - 1, len(live) - 1, -1))

    def masked_rows(self, width: int, words_per_row: int) -> MaskedGammaRows | None:
        """The entries' values summed with masks (:mod:`shim_adapters.shim.masked_gamma`) for
        logits ``width`` wide, or None where that does not pay (a sparse table, wide logits)."""
        rows = self._masked.get((width, words_per_row))
        if rows is None:
            if not self.dense or width > MAX_WIDTH:
                return None
            rows = self._masked[(width, words_per_row)] = MaskedGammaRows(width, words_per_row)
        return rows

    # ---- reporting -------------------------------------------------------------------------
    def clear(self) -> None:
        for entry in self._by_encoding.values():
            entry.alive = False
        self._keys.clear()
        self._last_keys = (_dead_ref, None)
        self._by_identity.clear()
        self._by_encoding.clear()
        self._n_keys = self._key_bytes = 0
        self._table = np.zeros((4, self.width), dtype=np.float32)
        self._table_t = torch.from_numpy(self._table)
        self._free = list(range(3, -1, -1))
        self._constant = None
        self._masked.clear()
        self.lookups = self.encoding_hits = self.misses = 0

    def info(self) -> dict[str, float]:
        """Hit rates, sizes and memory (bytes: the slot table, entries and keys)."""
        lookups = self.lookups
        hits = lookups - self.encoding_hits - self.misses
        return {"lookups": lookups, "hits": hits, "encoding_hits": self.encoding_hits,
                "misses": self.misses,
                "hit_rate": hits / lookups if lookups else float("nan"),
                "head_skip_rate": (hits + self.encoding_hits) / lookups if lookups
                else float("nan"),
                "keys": self._n_keys, "entries": len(self._by_encoding),
                "bytes": self._live_bytes(), "table_bytes": self._table.nbytes,
                "max_bytes": self.max_bytes,
                "masked_rows": sum(m.info()["rows"] for m in self._masked.values()),
                "masked_rows_bytes": sum(m.info()["bytes"] for m in self._masked.values())}


def shared_gamma_cache(controller, damped: bool = True,
                       max_bytes: int = DEFAULT_MAX_BYTES) -> GammaCache:
    """The controller's γ cache for these settings, shared by every adjuster over it, so the
    cache stays warm across ``generate`` calls and processors."""
    caches = controller.__dict__.setdefault("_gamma_caches", {})
    key = (bool(damped), int(max_bytes))
    cache = caches.get(key)
    if cache is None:
        cache = caches[key] = GammaCache(controller, damped=damped, max_bytes=max_bytes)
    return cache


def _dead_ref():
    """A weak reference that is always dead (no last masker yet)."""
    return None


def _size_of(key: Hashable) -> int:
    if isinstance(key, tuple):
        return sys.getsizeof(key) + sum(_size_of(k) for k in key)
    return sys.getsizeof(key)
