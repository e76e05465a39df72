"""Upstream bugs the conformance suite knows about: reported as xfail with their repro.

A failure that matches an entry here is counted as *xfailed* (with the bug id) instead of
failed, so a known upstream defect neither hides (it is still listed, with its minimised
repro) nor blocks CI. Each entry names the backend version it was seen in; a backend at
another version is judged without the entry, so a fix (or a regression) shows up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .report import Repro


@dataclass(frozen=True)
class KnownBug:
    id: str
    backend: str
    #: Backend versions (``Masker.backend_version``) the bug is known in.
    versions: tuple[str, ...]
    check: str
    kinds: tuple[str, ...]
    summary: str
    #: Minimal repro in words (the report carries the concrete one).
    repro: str
    #: Extra condition on the concrete failure (token text, grammar...); None: any of ``kinds``.
    matches: Callable[[Repro], bool] | None = None


def _schema(r: Repro) -> bool:
    return r.grammar.endswith(".json")


#: Found by the full profile (conformance/reports/conformance-full.md), all on JSON schemas.
KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        id="xgrammar-schema-raw-control-chars", backend="xgrammar", versions=("0.2.9",),
        check="soundness", kinds=("unsound_token",),
        summary="XGrammar's JSON-schema strings admit raw control characters (U+0000-U+001F), "
                "which RFC 8259 forbids unescaped",
        repro="schema conformance/grammars/person.json, GPT-2: after '{\"name\":\"/' the "
              "tokens '\\x1f' (219) and '\\t' (197) are allowed",
        matches=lambda r: _schema(r) and any(ord(c) < 0x20 for c in (r.token_text or ""))),
    KnownBug(
        id="xgrammar-schema-escapes-refused", backend="xgrammar", versions=("0.2.9",),
        check="completeness", kinds=("valid_token_refused",),
        summary="XGrammar refuses escape sequences in JSON-schema strings with maxLength",
        repro="person.json, GPT-2: after '{\"name\":\"' the token '\\' (59) is refused "
              "though '{\"name\":\"\\n\",\"age\":7,\"role\":\"user\"}' is valid",
        matches=lambda r: _schema(r) and "\\" in (r.token_text or "")),
    KnownBug(
        id="xgrammar-schema-escapes-refused-edge", backend="xgrammar", versions=("0.2.9",),
        check="tokenizer_edges", kinds=("refused_leading_space", "refused_multi_terminal"),
        summary="the same escape refusal, seen on leading-space / multi-terminal tokens",
        repro="person.json, Qwen2.5: token ' \"\\\"' (15898) refused after '{\"name\":'",
        matches=lambda r: _schema(r) and "\\" in (r.token_text or "")),
    KnownBug(
        id="outlines-core-schema-integer-bounds", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="soundness", kinds=("eos_not_accepting",),
        summary="outlines_core's schema-to-regex ignores integer minimum/maximum",
        repro="person.json (age: minimum 0, maximum 120), GPT-2: EOS allowed after "
              "'{\"name\":\"/\",\"age\":-787,\"role\":\"guest\"}'",
        matches=_schema),
    KnownBug(
        id="outlines-core-schema-whitespace", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="completeness", kinds=("valid_token_refused",),
        summary="outlines_core's default whitespace pattern admits no newline between JSON "
                "tokens (valid pretty-printed JSON is refused)",
        repro="person.json, GPT-2: after '{' the token '\\n' (198) is refused",
        matches=lambda r: _schema(r) and "\n" in (r.token_text or "")),
    KnownBug(
        id="outlines-core-schema-whitespace-edge", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="tokenizer_edges", kinds=("refused_multi_terminal", "refused_leading_space"),
        summary="the same whitespace restriction, seen on multi-terminal tokens such as '{\\n'",
        repro="person.json, Qwen2.5: token '{\\n' (515) refused at the start",
        matches=lambda r: _schema(r) and "\n" in (r.token_text or "")),
)


def match_known_bug(repro: Repro, backend_version: str) -> str | None:
    """The id of the known bug ``repro`` is an instance of, or None."""
    for bug in KNOWN_BUGS:
        if (bug.backend == repro.backend and backend_version in bug.versions
                and bug.check == repro.check and repro.kind in bug.kinds
                and (bug.matches is None or bug.matches(repro))):
            return bug.id
    return None
