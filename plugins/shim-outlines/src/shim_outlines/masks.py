"""Shared pieces of the outlines maskers: logit width, EOS ids, packed-bitmask conversion."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from shim_adapters.errors import VocabMismatchError


def resolve_width(tokenizer, vocab_size: int | None) -> int:
    """The model's logit width; never narrower than the tokenizer (ids would fall off)."""
    n = len(tokenizer)
    if vocab_size is None:
        return n
    if vocab_size < n:
        raise VocabMismatchError(f"logits width {vocab_size} is smaller than the tokenizer's "
                                 f"{n} tokens; pass the model's output width as vocab_size")
    return int(vocab_size)


def resolve_eos(tokenizer, eos_token_ids: Iterable[int] | None) -> frozenset[int]:
    if eos_token_ids is None:
        if tokenizer.eos_token_id is None:
            raise VocabMismatchError("the tokenizer has no eos_token_id; pass eos_token_ids")
        eos_token_ids = [tokenizer.eos_token_id]
    ids = frozenset(int(t) for t in eos_token_ids)
    if not ids or any(t < 0 or t >= len(tokenizer) for t in ids):
        raise VocabMismatchError(f"EOS ids {sorted(ids)} are not ids of the tokenizer "
                                 f"(0..{len(tokenizer) - 1})")
    return ids


def bitmask_to_bool(bitmask: np.ndarray, n_tokens: int, width: int) -> np.ndarray:
    """int32 bitmask (bit i of word i//32 = token i) -> bool array of ``width``.

    Ids at or beyond ``n_tokens`` (padding) are always False.
    """
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=n_tokens)
    out = np.zeros(width, dtype=np.bool_)
    out[:n_tokens] = bits.view(np.bool_)
    return out


def bit_is_set(bitmask: np.ndarray, token_id: int) -> bool:
    return bool((int(bitmask.reshape(-1)[token_id >> 5]) >> (token_id & 31)) & 1)
