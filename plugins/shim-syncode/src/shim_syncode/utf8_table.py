"""Which tokens continue an unfinished UTF-8 character, for the whole vocabulary at once.

Mid-character (the output ends in a lead byte and maybe some continuation bytes), a token is
allowed only if ``pending + token`` is still well-formed UTF-8 (:func:`utf8_prefix_ok`). That is
decided by the token's first three bytes and whether the rest of it is clean from byte 1, 2
or 3, so a table of those answers the question with a few array comparisons.
"""

from __future__ import annotations

import numpy as np

from shim_adapters.mask.utf8 import UTF8_FORMS, utf8_prefix_ok

#: The multi-byte forms of well-formed UTF-8 (lead byte range -> ranges of the bytes after it).
_FORMS = tuple(form for form in UTF8_FORMS if form[1])


class Utf8Continuations:
    """Per token: its first three bytes (256: none) and ``utf8_prefix_ok(token[m:])``."""

    def __init__(self, token_bytes: list[bytes]):
        n = len(token_bytes)
        self.heads = np.full((n, 3), 256, dtype=np.int16)
        self.clean_from = np.ones((n, 4), dtype=np.bool_)
        for i, data in enumerate(token_bytes):
            head = data[:3]
            self.heads[i, :len(head)] = np.frombuffer(head, dtype=np.uint8)
            if data.isascii():
                continue  # clean from every offset
            for m in range(min(len(data), 4)):
                self.clean_from[i, m] = utf8_prefix_ok(data[m:])

    def after(self, pending: bytes) -> np.ndarray | None:
        """``utf8_prefix_ok(pending + token)`` for every token, or None when ``pending`` is not
        the start of one well-formed character (the caller then checks tokens one by one)."""
        if not pending:
            return self.clean_from[:, 0].copy()
        rest = next((r for (lo, hi), r in _FORMS if lo <= pending[0] <= hi), None)
        if rest is None or len(pending) > len(rest):
            return None
        if any(not lo <= b <= hi for b, (lo, hi) in zip(pending[1:], rest)):
            return None
        need = rest[len(pending) - 1:]  # ranges of the bytes still missing (1 to 3)
        ok = np.ones(len(self.heads), dtype=np.bool_)
        for k, (lo, hi) in enumerate(need):
            head = self.heads[:, k]
            ok &= (head == 256) | ((head >= lo) & (head <= hi))
        return ok & self.clean_from[:, len(need)]
