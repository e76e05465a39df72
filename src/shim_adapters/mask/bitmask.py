"""Packed token bitmasks in XGrammar's layout (the layout vLLM and SGLang pass around).

A batch's masks are one int32 tensor of shape ``(batch, ceil(vocab_size / 32))``; token ``t``
of row ``r`` is allowed when bit ``t % 32`` (least significant first) of word ``t // 32`` is
set. Bits past ``vocab_size`` are ignored. A state fills its row in place
(:meth:`~shim_adapters.mask.protocol.MaskerState.fill_next_token_bitmask`), and
:func:`apply_token_bitmask_` masks a batch of logits with one vectorised op (cached bool
rows or numpy on CPU, torch bit operations elsewhere), so no per-row bool array or device round trip is on the hot
path.
The core imports no backend: a masker may hand in its backend's own kernel instead
(:meth:`~shim_adapters.mask.protocol.Masker.apply_token_bitmask_`).
"""

from __future__ import annotations

import numpy as np
import torch

from shim_adapters.mask.expansion import apply_expanded_

#: Bits per bitmask word.
BITS_PER_WORD = 32


class _LastTwo:
    """``make(obj)`` remembered for the last two objects, most recent first. The objects are
    held, so an identity match is never a recycled object."""

    __slots__ = ("make", "first", "second")

    def __init__(self, make):
        self.make = make
        self.first = self.second = (None, None)

    def __call__(self, obj):
        first = self.first
        if first[0] is obj:
            return first[1]
        second = self.second
        if second[0] is obj:
            self.first, self.second = second, first
            return second[1]
        value = self.make(obj)
        self.first, self.second = (obj, value), first
        return value


def _int32_items(words: np.ndarray) -> memoryview | None:
    if words.dtype != np.int32 or not words.flags.c_contiguous:
        return None
    return memoryview(words).cast("B").cast("i")


_VIEWS = _LastTwo(lambda tensor: tensor.numpy())
_ITEMS = _LastTwo(_int32_items)


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """``tensor.numpy()``, remembered for the last two tensors. One processor call adds γ to
    and masks one logits tensor with one preallocated bitmask, and ``numpy()`` is not free
    inside ``generate`` (``benchmarks/gamma_mask_cost.md``, 'numpy views remembered'). A tensor
    given new storage in place (``set_``, ``resize_``) is not a case the hot path has. Raises
    as ``numpy()`` does (GPU, grad)."""
    return _VIEWS(tensor)


def word_items(words: np.ndarray) -> memoryview | None:
    """A flat int32 memoryview of a C-contiguous numpy bitmask (word ``w`` of row ``r`` at
    ``r * words.shape[1] + w``), remembered for the last two arrays; None for any other
    layout. Inside ``generate`` (caches cold) reading or writing a few words through it costs
    less than numpy's item access (``benchmarks/gamma_mask_cost.md``, 'fix-up words')."""
    return _ITEMS(words)


def bitmask_words(vocab_size: int) -> int:
    """Words per row for ``vocab_size`` tokens."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return (int(vocab_size) + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A ``(batch_size, words)`` int32 CPU tensor with every bit set (everything allowed),
    as ``xgrammar.allocate_token_bitmask`` makes it."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def pack_mask(mask: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Pack a bool mask over the vocabulary into int32 words (``out``: one row to fill)."""
    mask = np.asarray(mask, dtype=bool)
    words = bitmask_words(len(mask))
    packed = np.packbits(mask, bitorder="little")
    padded = np.zeros(words * 4, dtype=np.uint8)
    padded[:len(packed)] = packed
    if out is None:
        return padded.view(np.int32).copy()
    if out.shape != (words,) or out.dtype != np.int32:
        raise ValueError(f"bitmask row has shape {out.shape} and dtype {out.dtype}; expected "
                         f"({words},) int32 for {len(mask)} tokens")
    out[:] = padded.view(np.int32)
    return out


def unpack_bitmask(row: np.ndarray | torch.Tensor, vocab_size: int) -> np.ndarray:
    """The bool mask of one bitmask row (``allowed_mask()``'s form)."""
    if isinstance(row, torch.Tensor):
        row = row.detach().cpu().numpy()
    row = np.ascontiguousarray(row, dtype=np.int32)
    return np.unpackbits(row.view(np.uint8), count=int(vocab_size), bitorder="little").view(bool)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)
    return s


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(batch, vocab_size) bool tensor of a packed bitmask (torch bit operations only)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dim()}-D "
                         f"{bitmask.dtype}")
    if bitmask.shape[1] * BITS_PER_WORD < vocab_size:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row: too few for "
                         f"{vocab_size} tokens")
    bits = torch.bitwise_and(torch.bitwise_right_shift(bitmask.unsqueeze(-1),
                                                       _shifts(bitmask.device)), 1)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set ``logits[r, t]`` to -inf wherever bit t of row r is clear; in place, returns logits.

    ``logits``: (batch, vocab) on any device; ``bitmask``: (batch, words) int32 (moved to the
    logits' device if needed). Columns past the bitmask's ``words * 32`` are masked too.
    On CPU each row's forbidden tokens come from :mod:`shim_adapters.mask.expansion` (the
    row's bytes looked up, one ``masked_fill_``); rows too wide to cache are unpacked with
    numpy and written with one ``copyto``. On real masks both cost less than XGrammar's CPU
    kernel and the torch bit operations (:func:`apply_token_bitmask_torch_`) used on other
    devices (``benchmarks/gamma_mask_cost.md``, 'mask kernel').
    """
    if (logits.is_cpu and bitmask.is_cpu and bitmask.dtype is torch.int32
            and logits.dim() == 2 and bitmask.dim() == 2
            and logits.shape[0] == bitmask.shape[0]):  # not len(): a Python call each
        words = numpy_view(bitmask)
        width = logits.shape[1]
        covered = min(width, words.shape[1] * BITS_PER_WORD)
        if apply_expanded_(logits, words, covered):
            if covered < width:
                logits[:, covered:] = float("-inf")
            return logits
        if logits.dtype in _NUMPY_FLOATS and not logits.requires_grad:
            view = numpy_view(logits)
            np.copyto(view[:, :covered], -np.inf, where=_forbidden_bools(words, covered))
            if covered < width:
                view[:, covered:] = -np.inf
            return logits
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must "
                         f"be 2-D with the same number of rows")
    width = logits.shape[1]
    covered = min(width, bitmask.shape[1] * BITS_PER_WORD)
    if logits.device.type == "cpu" and bitmask.device.type == "cpu":
        if bitmask.dtype != torch.int32:
            raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
        # half precision, or a tensor that records gradients: torch's masked_fill_
        forbidden = _forbidden_bools(numpy_view(bitmask), covered)
        logits[:, :covered].masked_fill_(torch.from_numpy(forbidden), float("-inf"))
    else:
        apply_token_bitmask_torch_(logits, bitmask)
    if covered < width:
        logits[:, covered:] = float("-inf")
    return logits


#: Logit dtypes the CPU kernel writes through numpy.
_NUMPY_FLOATS = (torch.float32, torch.float64)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The device path of :func:`apply_token_bitmask_` (torch bit operations, any device),
    over the columns the bitmask covers; shapes are checked by the caller."""
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    covered = min(logits.shape[1], bitmask.shape[1] * BITS_PER_WORD)
    logits[:, :covered].masked_fill_(~bitmask_to_bool(bitmask, covered), float("-inf"))


def _forbidden_bools(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """(batch, vocab_size) bool, True where a numpy bitmask's bit is clear (forbidden)."""
    inverted = np.invert(words, order="C")  # C order: its bytes are each row's bits in order
    return np.unpackbits(inverted.view(np.uint8), axis=1, count=int(vocab_size),
                         bitorder="little").view(bool)


def numpy_rows_with_any(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """:func:`rows_with_any` of a numpy bitmask."""
    full, rest = divmod(int(vocab_size), BITS_PER_WORD)
    any_ = np.bitwise_or.reduce(words[:, :full], axis=1) != 0  # cheaper than any()
    if rest:
        any_ |= (words[:, full] & ((1 << rest) - 1)) != 0
    return any_


_or_reduce = np.bitwise_or.reduce


def numpy_first_empty_row(words: np.ndarray, vocab_size: int) -> int | None:
    """The first row of a numpy bitmask that allows none of the first ``vocab_size`` tokens,
    or None. Every decoding step asks this once and the answer is almost always None, so the
    usual case is one reduction (one per row at batch 1), the tail word only looked at for a
    row whose full words are all zero."""
    full, rest = divmod(vocab_size, BITS_PER_WORD)
    if len(words) == 1:  # one reduction, no Python-level numpy wrapper (any() has one)
        if _or_reduce(words[0, :full]):
            return None
        candidates = [0]
    else:
        any_ = _or_reduce(words[:, :full], axis=1)  # cheaper than any(): 'dead-end check'
        if any_.all():
            return None
        candidates = np.flatnonzero(any_ == 0).tolist()
    tail = (1 << rest) - 1
    for row in candidates:
        if not rest or not int(words[row, full]) & tail:
            return row
    return None


class EmptyRowCheck:
    """:func:`numpy_first_empty_row` of one preallocated bitmask, asked once per decoding
    step. Up to :data:`MEMCMP_ROWS` rows it compares each row's full words with zero bytes
    through a memoryview: inside ``generate`` (caches cold after the LM's forward pass) that
    costs a fraction of numpy's reduction (``benchmarks/gamma_mask_cost.md``, 'dead-end
    check')."""

    def __init__(self, words: np.ndarray, vocab_size: int):
        self.words = words
        self.vocab_size = int(vocab_size)
        self._full, rest = divmod(self.vocab_size, BITS_PER_WORD)
        self._tail = (1 << rest) - 1
        self._data = memoryview(words).cast("B") if words.flags.c_contiguous else None
        self._row_bytes = 4 * words.shape[1]
        self._zero = bytes(4 * self._full)

    def __call__(self) -> int | None:
        data, words = self._data, self.words
        if data is None or len(words) > MEMCMP_ROWS:
            return numpy_first_empty_row(words, self.vocab_size)
        zero, row_bytes, tail = self._zero, self._row_bytes, self._tail
        span = len(zero)
        for row in range(len(words)):
            start = row * row_bytes
            if data[start:start + span] != zero:
                continue
            if not tail or not int(words[row, self._full]) & tail:
                return row
        return None


#: Rows up to which :class:`EmptyRowCheck` compares bytes (beyond, one numpy reduction).
MEMCMP_ROWS = 64


def rows_with_any(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(batch,) bool: which rows allow at least one of the first ``vocab_size`` tokens."""
    full, rest = divmod(int(vocab_size), BITS_PER_WORD)
    if bitmask.is_cpu:  # numpy: one reduction, no torch dispatch per op
        return torch.from_numpy(numpy_rows_with_any(bitmask.numpy(), vocab_size))
    any_ = (bitmask[:, :full] != 0).any(dim=1)
    if rest:
        any_ |= (bitmask[:, full] & ((1 << rest) - 1)) != 0
    return any_
