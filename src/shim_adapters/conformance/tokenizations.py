"""Judging a backend by the tokenizations it declares (``Masker.tokenizations``).

An LM may spell one output with many token splits. A backend that admits only some of them
is not broken if it says so, but a declaration is a claim the suite checks, never a pass:

- ``any``: every refused token whose bytes extend the output to a viable prefix is a
  completeness failure (canonical or not);
- ``canonical_in_forced_text``: such a refusal is excused only where it is a split of text the
  grammar *forces* (every byte of the token is the only viable next byte) and the mask allows
  another split of that same text; any other refusal is a failure;
- ``canonical``: refusals are judged only on canonical tokenizations of valid strings; the
  exhaustive per-token check judges allowed tokens only, and the report says so.
"""

from __future__ import annotations

import numpy as np

from shim_adapters.conformance.prefix import PrefixUndecided
from shim_adapters.conformance.reference_mask import _utf8_need, _witnesses
from shim_adapters.mask.protocol import Tokenizations
from shim_adapters.mask.vocab import decode_prefix


def declared_tokenizations(masker) -> Tokenizations:
    """The masker's declaration (``any`` when it declares none: judged on every split)."""
    value = getattr(masker, "tokenizations", Tokenizations.ANY)
    try:
        return Tokenizations(getattr(value, "value", value))
    except ValueError as exc:
        raise ValueError(f"{masker.backend_name}: unknown tokenizations declaration {value!r}; "
                         f"use one of {[t.value for t in Tokenizations]}") from exc


def _viable_bytes(ctx: "checks.CellContext", data: bytes) -> bool | None:
    """Whether ``data`` can still become output of the grammar; a trailing incomplete UTF-8
    character counts as viable when one of a few completions of it is (None: undecided)."""
    try:
        text, tail = decode_prefix(data)
    except UnicodeDecodeError:
        return False
    if not tail:
        return ctx.viable(data)
    if len(tail) >= _utf8_need(tail[0]):
        return False
    if ctx.prefix is None:
        return None
    for ch in _witnesses(tail):
        try:
            if ctx.prefix.viable(text + ch):
                return True
        except PrefixUndecided:
            return None
    return False


class ForcedText:
    """Which bytes the grammar forces after a prefix (memoised per prefix)."""

    def __init__(self, ctx: "checks.CellContext"):
        self.ctx = ctx
        self._forced: dict[bytes, int | None] = {}

    def forced_byte(self, data: bytes) -> int | None:
        """The only byte that can follow ``data`` in a viable output, or None (several can,
        or the reference cannot tell)."""
        if data in self._forced:
            return self._forced[data]
        found = None
        for c in range(256):
            verdict = _viable_bytes(self.ctx, data + bytes([c]))
            if verdict is None or (verdict and found is not None):
                found = None
                break
            if verdict:
                found = c
        self._forced[data] = found
        return found

    def is_forced(self, data: bytes, token: bytes) -> bool:
        """Every byte of ``token`` is forced after ``data``."""
        for i in range(len(token)):
            if self.forced_byte(data + token[:i]) != token[i]:
                return False
        return bool(token)


def excused_split(ctx: "checks.CellContext", forced: ForcedText, data: bytes, token: int,
                  mask: np.ndarray) -> bool:
    """Whether refusing ``token`` after ``data`` is what ``canonical_in_forced_text``
    declares: the token's bytes are forced text and the mask allows another token that
    spells a viable continuation of the same forced text (its canonical split)."""
    b = ctx.vocab.token_bytes[token] or b""
    if not forced.is_forced(data, b):
        return False
    for u in np.flatnonzero(mask & ctx.is_text):
        u = int(u)
        ub = ctx.vocab.token_bytes[u] or b""
        if u == token or not ub or not (ub.startswith(b) or b.startswith(ub)):
            continue
        if _viable_bytes(ctx, data + ub):
            return True
    return False
