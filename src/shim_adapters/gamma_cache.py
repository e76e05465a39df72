"""A bounded LRU cache of SHIM's β·log γ̂ per masker state.

Decoding revisits the same states (a grammar has few distinct parser configurations), so the
correction of a state is computed once and reused: a hit costs one dict lookup of
:meth:`~shim_adapters.protocol.MaskerState.feature_key` (no feature readout) and the caller's
one batched add. Entries hold the whole vocabulary's correction in the compact form of
:meth:`~shim_adapters.controller.Controller.state_log_gamma` (one float per token the controller
knows, relative to the shared value of every other token), so a hit never depends on which
tokens are allowed.

Two levels: ``feature_key -> entry`` (cheap key, exact identity of the features), and, on a
miss there, ``encoded state -> entry`` (the state's feature columns after the encoder dropped
what training never saw), so states that differ only in features the controller ignores share
one entry and skip the model head.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from .protocol import MaskerState

#: Default bound on the memory of cached corrections.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class GammaEntry:
    """One state's correction: ``shared`` for tokens without features of their own, and
    ``delta[i] = value(scored_token_ids[i]) - shared`` (float32, CPU)."""

    shared: float
    delta: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.delta.numel() * self.delta.element_size()) + 64


class GammaCache:
    """LRU cache of :class:`GammaEntry` per state for one fitted controller."""

    def __init__(self, controller, damped: bool = True, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.controller = controller
        self.damped = damped
        self.max_bytes = int(max_bytes)
        groups = set(controller.encoder_.groups)
        #: LR_NT reads no state: one entry serves every step.
        self.state_free = not groups & {"state", "cross"}
        self._by_key: OrderedDict[Hashable, tuple[bytes, bytes]] = OrderedDict()
        self._by_encoding: OrderedDict[tuple[bytes, bytes], GammaEntry] = OrderedDict()
        self._bytes = 0
        self._key_bytes = 0
        self.hits = 0
        self.encoding_hits = 0
        self.misses = 0
        self._constant: GammaEntry | None = None
        #: Keys are (masker id, feature key): two maskers may read one dump differently.
        self._maskers: dict[int, object] = {}

    # ---- lookup ----------------------------------------------------------------------------
    def entry(self, state: MaskerState) -> GammaEntry:
        """The correction at ``state`` (computed and stored on a miss)."""
        if self.state_free:
            if self._constant is None:
                self._constant = self._compute(state)
                self.misses += 1
            else:
                self.hits += 1
            return self._constant
        masker = state.masker
        if id(masker) not in self._maskers:
            self._maskers[id(masker)] = masker  # held, so that its id is never reused
        key = (id(masker), state.feature_key())
        ekey = self._by_key.get(key)
        if ekey is not None:
            hit = self._by_encoding.get(ekey)
            if hit is not None:
                self.hits += 1
                self._by_key.move_to_end(key)
                self._by_encoding.move_to_end(ekey)
                return hit
        else:
            self._key_bytes += _size_of(key)
        ekey, entry = self._lookup_encoded(state)
        self._by_key[key] = ekey
        self._evict()
        return entry

    def _lookup_encoded(self, state: MaskerState) -> tuple[tuple[bytes, bytes], GammaEntry]:
        controller = self.controller
        enc, state_pre = controller.encode_state(state.features())
        ekey = (enc.state_columns.tobytes(), enc.cross_keys.tobytes())
        hit = self._by_encoding.get(ekey)
        if hit is not None:
            self._by_encoding.move_to_end(ekey)
            self.encoding_hits += 1
            return ekey, hit
        self.misses += 1
        shared, values = controller.encoded_log_gamma(enc, state_pre, self.damped)
        entry = _entry(shared, values)
        self._by_encoding[ekey] = entry
        self._bytes += _entry_bytes(ekey, entry)
        return ekey, entry

    def _compute(self, state: MaskerState) -> GammaEntry:
        shared, values = self.controller.state_log_gamma(state.features(), self.damped)
        return _entry(shared, values)

    def _evict(self) -> None:
        """Oldest entries first until the memory bound holds (the newest always stays);
        a key whose entry went is dropped with it when it is looked up again."""
        while self._bytes + self._key_bytes > self.max_bytes and len(self._by_encoding) > 1:
            ekey, entry = self._by_encoding.popitem(last=False)
            self._bytes -= _entry_bytes(ekey, entry)
            if len(self._by_key) > 1:
                key, _ = self._by_key.popitem(last=False)
                self._key_bytes -= _size_of(key)
        while self._bytes + self._key_bytes > self.max_bytes and len(self._by_key) > 1:
            key, _ = self._by_key.popitem(last=False)
            self._key_bytes -= _size_of(key)

    # ---- reporting -------------------------------------------------------------------------
    def clear(self) -> None:
        self._by_key.clear()
        self._by_encoding.clear()
        self._bytes = self._key_bytes = 0
        self.hits = self.encoding_hits = self.misses = 0
        self._constant = None

    def info(self) -> dict[str, float]:
        """Hit rates, sizes and memory (bytes) of the cache."""
        lookups = self.hits + self.encoding_hits + self.misses
        return {"lookups": lookups, "hits": self.hits, "encoding_hits": self.encoding_hits,
                "misses": self.misses,
                "hit_rate": self.hits / lookups if lookups else float("nan"),
                "head_skip_rate": (self.hits + self.encoding_hits) / lookups if lookups
                else float("nan"),
                "keys": len(self._by_key), "entries": len(self._by_encoding),
                "bytes": self._bytes + self._key_bytes, "max_bytes": self.max_bytes}


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


def _entry(shared: float, values: np.ndarray) -> GammaEntry:
    delta = torch.from_numpy((values - shared).astype(np.float32))
    return GammaEntry(float(shared), delta)


def _entry_bytes(ekey: tuple[bytes, bytes], entry: GammaEntry) -> int:
    return entry.nbytes + len(ekey[0]) + len(ekey[1]) + 100


def _size_of(key: Hashable) -> int:
    if isinstance(key, tuple):
        return sys.getsizeof(key) + sum(_size_of(k) for k in key)
    return sys.getsizeof(key)
