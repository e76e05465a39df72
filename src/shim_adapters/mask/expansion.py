"""Packed mask rows expanded to bool tensors once, then reused by content.

Why: inside ``generate`` each processor call runs with the CPU caches cold after the LM's
forward pass, where torch's ``masked_fill_`` with a ready bool tensor costs a fraction of
unpacking a row's bits with numpy (or XGrammar's own CPU kernel): torch's kernels are warm,
the LM has just run them, and numpy's are not (``benchmarks/gamma_mask_cost.md``, 'mask
kernel', measured by ``benchmarks/cold_ops.py``).
Decoding revisits few distinct masks, so the expansion is cached, keyed on the row's bytes:
equal bytes are the same mask, so a hit is exact by construction.

Bounded: entries are charged their bool tensor and key; when full the cache starts over
(:meth:`ExpandedMasks.info` reports hits, misses and memory). One cache per (vocabulary
width, words per row) is shared process-wide: a bit pattern means the same tokens whatever
grammar or processor produced it.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

#: Default memory bound of one width's cache (bool tensors and keys).
DEFAULT_MAX_BYTES = 32 << 20
#: Rows wider than this many bytes are not cached: hashing the key would cost more than the
#: unpack it saves (Python hashes bytes at roughly 1-2 GB/s).
MAX_ROW_BYTES = 8 << 10

_ENTRY_OVERHEAD = 200  # dict slot, tensor object, bytes object headers


class ExpandedMasks:
    """``forbidden(key)``: the (width,) bool tensor of a packed row, True where its bit is
    clear; ``key`` is the row's bytes (``words_per_row * 4`` of them, little-endian words,
    XGrammar's layout)."""

    def __init__(self, width: int, words_per_row: int, max_bytes: int = DEFAULT_MAX_BYTES):
        if width < 1 or words_per_row * 32 < width:
            raise ValueError(f"{words_per_row} words per row cannot hold {width} tokens")
        self.width = int(width)
        self.words_per_row = int(words_per_row)
        self.max_bytes = int(max_bytes)
        self._masks: dict[bytes, torch.Tensor] = {}
        self._entry_bytes = self.width + 4 * self.words_per_row + _ENTRY_OVERHEAD
        self.hits = self.misses = self.resets = 0

    def forbidden(self, key: bytes) -> torch.Tensor:
        mask = self._masks.get(key)
        if mask is not None:
            self.hits += 1
            return mask
        return self._expand(key)

    def _expand(self, key: bytes) -> torch.Tensor:
        if len(key) != 4 * self.words_per_row:
            raise ValueError(f"a packed row of {self.words_per_row} words has "
                             f"{4 * self.words_per_row} bytes, got {len(key)}")
        self.misses += 1
        bits = np.unpackbits(np.frombuffer(key, dtype=np.uint8), count=self.width,
                             bitorder="little")
        mask = torch.from_numpy(bits == 0)
        if (len(self._masks) + 1) * self._entry_bytes > self.max_bytes:
            self._masks.clear()
            self.resets += 1
        self._masks[key] = mask
        return mask

    def info(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {"entries": len(self._masks), "bytes": len(self._masks) * self._entry_bytes,
                "hits": self.hits, "misses": self.misses, "resets": self.resets,
                "hit_rate": self.hits / lookups if lookups else 0.0}


_CACHES: dict[tuple[int, int], ExpandedMasks] = {}
_LOCK = threading.Lock()


def expanded_masks(width: int, words_per_row: int) -> ExpandedMasks:
    """The process-wide cache for rows of ``words_per_row`` words over ``width`` tokens."""
    key = (int(width), int(words_per_row))
    cache = _CACHES.get(key)
    if cache is None:
        with _LOCK:
            cache = _CACHES.setdefault(key, ExpandedMasks(*key))
    return cache


def apply_expanded_(logits: torch.Tensor, words: np.ndarray, width: int) -> bool:
    """Mask the first ``width`` columns of CPU ``logits`` (rows, >= width) with the cached
    expansion of each row of the C-contiguous numpy bitmask ``words``; False (nothing done)
    when the rows are too wide to cache."""
    rows, per_row = words.shape
    row_bytes = 4 * per_row
    if row_bytes > MAX_ROW_BYTES or not words.flags.c_contiguous:
        return False
    cache = expanded_masks(width, per_row)
    data = memoryview(words).cast("B")
    target = logits if logits.shape[1] == width else logits[:, :width]
    if rows == 1:
        target.masked_fill_(cache.forbidden(data.tobytes()), float("-inf"))
    else:
        forbidden = cache.forbidden
        target.masked_fill_(torch.stack([forbidden(data[r * row_bytes:(r + 1) * row_bytes]
                                                   .tobytes()) for r in range(rows)]),
                            float("-inf"))
    return True
