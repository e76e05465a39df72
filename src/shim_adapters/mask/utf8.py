"""Well-formed UTF-8 prefixes: which byte strings some continuation can still make valid text.

Byte-level tokenizers split multi-byte characters across tokens, so a constrained decoder must
allow a token that ends mid-character exactly when some bytes can still complete it, and refuse
one that makes the output invalid UTF-8 for ever (a stray continuation byte, 0xF5, a surrogate
or overlong lead). Python's incremental decoder is lenient on cut-off surrogates (it buffers
``ED A0``), so the check follows Unicode's Table 3-7 directly.
"""

from __future__ import annotations

#: Well-formed UTF-8 (Unicode Table 3-7): lead byte range -> ranges of the bytes after it.
UTF8_FORMS = (
    ((0x00, 0x7F), ()),
    ((0xC2, 0xDF), ((0x80, 0xBF),)),
    ((0xE0, 0xE0), ((0xA0, 0xBF), (0x80, 0xBF))),
    ((0xE1, 0xEC), ((0x80, 0xBF), (0x80, 0xBF))),
    ((0xED, 0xED), ((0x80, 0x9F), (0x80, 0xBF))),
    ((0xEE, 0xEF), ((0x80, 0xBF), (0x80, 0xBF))),
    ((0xF0, 0xF0), ((0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF))),
    ((0xF1, 0xF3), ((0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF))),
    ((0xF4, 0xF4), ((0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF))),
)


def utf8_prefix_ok(data: bytes) -> bool:
    """Whether ``data`` is well-formed UTF-8 up to a possibly unfinished last character that
    some bytes can still complete (surrogates and overlongs are rejected even when cut off)."""
    i, n = 0, len(data)
    while i < n:
        lead = data[i]
        for (lo, hi), rest in UTF8_FORMS:
            if lo <= lead <= hi:
                break
        else:
            return False
        for k, (lo, hi) in enumerate(rest, start=1):
            if i + k >= n:
                return True  # cut off inside a character that can still be completed
            if not lo <= data[i + k] <= hi:
                return False
        i += 1 + len(rest)
    return True


def incomplete_tail(data: bytes) -> bytes:
    """The bytes of an unfinished last character of ``data`` (empty when it ends cleanly).

    Assumes ``data`` passes :func:`utf8_prefix_ok`; only the last three bytes are read."""
    for k in range(1, min(3, len(data)) + 1):
        byte = data[-k]
        if byte < 0x80:
            return b""
        if byte >= 0xC0:  # a lead byte: unfinished if its character needs more than k bytes
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data[-k:] if need > k else b""
    return b""
