"""Bugs the conformance suite knows about: reported as xfail with their repro.

A failure counts as *xfailed* (with the bug id) instead of failed only when it matches an
entry *narrowly*: the backend and the exact backend version the bug was seen in, the check
and failure kind, and the construct that shows it (a raw control character inside a JSON
string, an escape in a ``maxLength`` string, an integer outside a schema's bounds...), never
"any EOS violation of a schema". A backend at another version is judged without the entry, so
a fix or a regression shows. A cell where an entry applies (backend, version and construct
present in the grammar) but the bug was not met lists it as *stale*: the report says the
known bug no longer reproduces there (``--fail-on stale-known-bugs`` makes that fail).
Sampling with a time cap can miss a bug that is still there, so an entry with a :class:`Probe`
is replayed before it is called stale: the probe looks at the exact tokens the bug is about,
at fixed cut points of valid strings, and only a probe that looked and found the bug gone
makes the entry stale.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Callable, Sequence

from shim_adapters.conformance.prefix import prefix_checker
from shim_adapters.conformance.report import Repro
from shim_adapters.grammars.grammar import Grammar


@dataclass(frozen=True)
class Probe:
    """A deterministic replay of a known bug (see the module docstring).

    At each cut point ``at(text)`` of a valid string, the tokens whose text satisfies
    ``token`` are looked at; the bug shows when one of them is allowed
    (``shows_when_allowed``: an unsound allowance, and the reference must call the extended
    text not viable) or refused (the reference must call it viable)."""

    at: Callable[[str], list[int]]
    token: Callable[[str], bool]
    shows_when_allowed: bool


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
    #: The construct: which concrete failures are this bug (repro, grammar under test).
    matches: Callable[[Repro, "Grammar | None"], bool]
    #: Whether a grammar contains the construct (the bug is then expected in the cell).
    applies_to: Callable[[Grammar], bool]
    #: Whether a cell not meeting the bug makes it stale (False: the check only samples it).
    expect_reproduced: bool = True
    #: How to replay the bug where sampling did not meet it (None: not meeting it is stale).
    probe: Probe | None = None


def _schema(grammar: Grammar) -> dict | None:
    if grammar.format != "json_schema":
        return None
    try:
        return json.loads(grammar.text)
    except ValueError:
        return None


def _walk_schema(schema) -> list[dict]:
    out = []
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            out.append(node)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return out


def _schema_has(pred: Callable[[dict], bool]) -> Callable[[Grammar], bool]:
    def applies(grammar: Grammar) -> bool:
        schema = _schema(grammar)
        return schema is not None and any(pred(n) for n in _walk_schema(schema))
    return applies


def _is_schema_repro(r: Repro) -> bool:
    return r.grammar.endswith(".json")


def _inside_json_string(text: str) -> bool:
    """Whether ``text`` ends inside a JSON string literal (odd number of unescaped quotes)."""
    count = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            count += 1
    return count % 2 == 1


def _outside_strings(prefix: str, added: str) -> str:
    """The prefix's last character and the token's text, keeping only what lies outside JSON
    string literals (a token '"\\n' after '{"name' closes the key, then writes a newline)."""
    inside = _inside_json_string(prefix)
    escaped = False
    out = [prefix[-1:]] if prefix and not inside else []
    for ch in added:
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside = True
            out.append("|")  # a string literal separates whitespace runs
        else:
            out.append(ch)
    return "".join(out)


def _json_whitespace_beyond_one_space(token_text: str) -> bool:
    """The token has JSON whitespace other than single spaces (a newline, tab, CR, a run)."""
    return any(c in token_text for c in "\n\t\r") or "  " in token_text


def _starts_unicode_escape(prefix: str, added: str) -> bool:
    """The token writes (part of) a \\u escape inside a JSON string: read from the prefix's
    string/escape state on, its text has a backslash-u inside a string (a token may also open
    the string first, as '"\\u' does after a key's colon)."""
    inside = escaped = False
    for ch in prefix:
        inside, escaped = _json_string_step(inside, escaped, ch)
    for ch in added:
        if inside and escaped and ch == "u":
            return True
        inside, escaped = _json_string_step(inside, escaped, ch)
    return False


def _json_string_step(inside: bool, escaped: bool, ch: str) -> tuple[bool, bool]:
    """(inside a string, after an unescaped backslash) once ``ch`` is read."""
    if not inside:
        return ch == '"', False
    if escaped:
        return True, False
    if ch == "\\":
        return True, True
    return ch != '"', False


def _adds_del_or_c1(r: Repro) -> bool:
    """The token completes a DEL or C1 control character (U+007F-U+009F)."""
    return any(0x7F <= ord(c) <= 0x9F for c in (r.added_text or ""))


def _is_bytes_display(token_text: str | None) -> bool:
    """Repros show a token whose bytes are not valid UTF-8 as a bytes literal."""
    return bool(token_text) and token_text[:2] in ("b'", 'b"') and "\\x" in token_text


def _tok(r: Repro) -> str | None:
    """The token's own text, compared as bytes: None for a token whose bytes are not whole
    UTF-8 characters (its display ``b'\\xed'`` is no text of the token)."""
    if r.token_hex is not None:
        return r.token_str
    return None if _is_bytes_display(r.token_text) else r.token_text


def _is_partial_utf8_token(r: Repro) -> bool:
    """The token's bytes are not whole UTF-8 characters (a byte-level or byte-fallback piece)."""
    if r.token_hex is not None:
        return bool(r.token_bytes) and r.token_str is None
    return _is_bytes_display(r.token_text)


def _string_owner(text: str) -> tuple[str | None, bool] | None:
    """Where ``text`` (a JSON prefix) ends when it ends inside a string value: (the key of
    the member whose value it is, whether it is an item of that member's array). None when
    it ends outside a string or inside a key."""
    stack: list[list] = []  # [container, current key, expecting a key]
    inside = escaped = False
    buf: list[str] = []
    last_string = None
    for ch in text:
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
                last_string = "".join(buf)
                if stack and stack[-1][0] == "{" and stack[-1][2]:
                    stack[-1][1], stack[-1][2] = last_string, False
                continue
            buf.append(ch)
            continue
        if ch == '"':
            inside, buf = True, []
        elif ch in "{[":
            stack.append([ch, None, ch == "{"])
        elif ch in "}]":
            if stack:
                stack.pop()
        elif ch == "," and stack and stack[-1][0] == "{":
            stack[-1][2] = True
    if not inside or not stack:
        return None
    top = stack[-1]
    if top[0] == "{":
        return None if top[2] else (top[1], False)
    parent = stack[-2] if len(stack) > 1 else None
    return (parent[1] if parent and parent[0] == "{" else None, True)


def _in_string_with(keyword: str, grammar: "Grammar | None", text: str) -> bool:
    """Whether ``text`` ends inside a string value that the schema bounds by ``keyword``
    (the member's schema, or its array's ``items`` schema, has it)."""
    schema = _schema(grammar) if grammar is not None else None
    owner = _string_owner(text)
    if schema is None or owner is None:
        return False
    key, item = owner
    for node in _walk_schema(schema):
        props = node.get("properties")
        if not isinstance(props, dict) or key not in props or not isinstance(props[key], dict):
            continue
        sub = props[key].get("items") if item else props[key]
        if isinstance(sub, dict) and keyword in sub:
            return True
    return False


def _escape_in_max_length_string(r: Repro, g: "Grammar | None") -> bool:
    """The refused token writes a backslash (its bytes, not its display) inside a string
    value that the schema bounds by ``maxLength``."""
    text = _tok(r)
    if not _is_schema_repro(r) or not text or "\\" not in text:
        return False
    return _in_string_with("maxLength", g, r.prefix_text + text[:text.index("\\")])


def _ends_complete_json(prefix: str) -> bool:
    try:
        json.loads(prefix)
    except ValueError:
        return False
    return True


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


def _only_bound_violations(r: Repro, grammar: Grammar | None) -> bool:
    """EOS accepted where the JSON is well-formed and breaks the schema only by numeric
    bounds (``minimum``/``maximum``): not any other schema violation."""
    schema = _schema(grammar) if grammar is not None else None
    if schema is None:
        return False
    if r.token_id is not None:
        # A token the schema refuses (an integer past its bound, ended by the token) that
        # the same schema without integer bounds takes.
        text = r.prefix_text + (r.added_text if r.added_text is not None else _tok(r) or "")
        return _without_integer_bounds(json.dumps(schema, sort_keys=True)).viable(text)
    try:
        value = json.loads(r.prefix_text)
    except ValueError:
        return False
    import jsonschema

    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(value))
    return bool(errors) and all(e.validator in _BOUNDS for e in errors)


@functools.lru_cache(maxsize=8)
def _without_integer_bounds(schema_text: str):
    """The relaxed prefix reference of a schema with every integer's bounds dropped."""
    def strip(node, names=False):
        if isinstance(node, dict):
            drop = () if names or node.get("type") != "integer" else _BOUNDS
            return {k: strip(v, k in ("properties", "$defs", "definitions") and not names)
                    for k, v in node.items() if k not in drop}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return prefix_checker(Grammar(json.dumps(strip(json.loads(schema_text))), "json_schema",
                                  "without-integer-bounds"))


_PLUGIN_FIX = "the plugins' maskers allow every such token that can still complete a character"

def _trailing_whitespace_bug(backend: str, version: str, who: str, tokens: str) -> KnownBug:
    return KnownBug(
        id=f"{'outlines-core' if backend == 'outlines' else backend}-schema-trailing-"
           "whitespace-refused", backend=backend, versions=(version,),
        check="completeness", kinds=("valid_token_refused", "non_canonical_refused"),
        summary=f"{who} ends with the top-level value: whitespace after it, which RFC 8259 "
                "allows (JSON-text = ws value ws), is refused",
        repro=f"person.json / note.json, shipped tokenizer: after a complete object such as "
              f"'{{\"title\":\"a\",\"tags\":[]}}' the tokens {tokens} are refused",
        matches=lambda r, g: _is_schema_repro(r) and _ends_complete_json(r.prefix_text)
        and bool(_tok(r)) and not (_tok(r) or "x").strip(" \t\n\r"),
        applies_to=lambda g: g.format == "json_schema",
        probe=Probe(at=lambda s: [len(s)], token=lambda t: t in ("\n", " ", "\t"),
                    shows_when_allowed=False))


#: Found by the full profile (conformance/reports/), all on JSON schemas, and our own plugins'
#: partial-UTF-8 refusal found by the exhaustive mask check.
KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        id="xgrammar-schema-escapes-refused", backend="xgrammar", versions=("0.2.9",),
        check="completeness", kinds=("valid_token_refused", "non_canonical_refused"),
        summary="XGrammar refuses escape sequences in JSON-schema strings with maxLength",
        repro="person.json, GPT-2: after '{\"name\":\"' the token '\\' (59) is refused "
              "though '{\"name\":\"\\n\",\"age\":7,\"role\":\"user\"}' is valid",
        matches=_escape_in_max_length_string,
        applies_to=_schema_has(lambda n: n.get("type") == "string" and "maxLength" in n)),
    KnownBug(
        id="xgrammar-schema-escapes-refused-edge", backend="xgrammar", versions=("0.2.9",),
        check="tokenizer_edges", kinds=("refused_leading_space", "refused_multi_terminal"),
        summary="the same escape refusal, seen on leading-space / multi-terminal tokens",
        repro="person.json, Qwen2.5: token ' \"\\\"' (15898) refused after '{\"name\":'",
        matches=_escape_in_max_length_string,
        applies_to=_schema_has(lambda n: n.get("type") == "string" and "maxLength" in n),
        expect_reproduced=False),
    KnownBug(
        id="outlines-core-schema-integer-bounds", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="soundness", kinds=("eos_not_accepting", "unsound_token"),
        summary="outlines_core's schema-to-regex ignores integer minimum/maximum",
        repro="person.json (age: minimum 0, maximum 120), GPT-2: EOS allowed after "
              "'{\"name\":\"/\",\"age\":-787,\"role\":\"guest\"}'",
        matches=_only_bound_violations,
        applies_to=_schema_has(lambda n: n.get("type") == "integer"
                               and ("minimum" in n or "maximum" in n)),
        expect_reproduced=False),
    KnownBug(
        id="outlines-core-schema-del-c1-refused", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="completeness",
        kinds=("valid_token_refused", "non_canonical_refused", "refused_partial_utf8"),
        summary="outlines_core's schema-to-regex string class [^\"\\\\\\x00-\\x1F\\x7F-\\x9F] "
                "refuses raw DEL and C1 control characters (U+007F-U+009F) inside JSON strings, "
                "which RFC 8259 allows unescaped",
        repro="person.json, GPT-2: after '{\"name\":\"' the token '\\x7f' (221) is refused; "
              "after '{\"name\": \"1ß,o' + byte <0xC2> the byte token <0x85> (U+0085) is "
              "refused though '{\"name\":\"\\u0085\",\"age\":0,\"role\":\"user\"}' "
              "spelled raw is valid",
        matches=lambda r, g: _is_schema_repro(r) and _inside_json_string(r.prefix_text)
        and _adds_del_or_c1(r),
        applies_to=_schema_has(lambda n: n.get("type") == "string" and "enum" not in n
                               and "pattern" not in n),
        expect_reproduced=False),
    KnownBug(
        id="outlines-core-schema-del-c1-refused-edge", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="tokenizer_edges", kinds=("refused_partial_utf8", "refused_leading_space",
                                        "refused_multi_terminal"),
        summary="the same DEL/C1 refusal, seen on a partial-UTF-8 byte token",
        repro="person.json, GPT-2: byte token <0x85> after <0xC2> inside a name string",
        matches=lambda r, g: _is_schema_repro(r) and _inside_json_string(r.prefix_text)
        and _adds_del_or_c1(r),
        applies_to=_schema_has(lambda n: n.get("type") == "string"), expect_reproduced=False),
    KnownBug(
        id="outlines-core-schema-unicode-escape-refused", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="completeness", kinds=("valid_token_refused", "non_canonical_refused"),
        summary="outlines_core's schema-to-regex admits only the short escapes \\[\"\\\\/bfnrt] "
                "in JSON strings: \\uXXXX escapes are refused (upstream: "
                "dottxt-ai/outlines-core pull request 189, open)",
        repro="person.json, shipped tokenizer: after '{\"name\": \" n_\\' the token 'u' is "
              "refused though '{\"name\":\"\\u0001\",\"age\":0,\"role\":\"user\"}' is valid",
        matches=lambda r, g: _is_schema_repro(r)
        and _starts_unicode_escape(r.prefix_text, r.added_text or _tok(r) or ""),
        applies_to=_schema_has(lambda n: n.get("type") == "string" and "enum" not in n
                               and "pattern" not in n),
        expect_reproduced=False),
    KnownBug(
        id="outlines-core-schema-whitespace", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="completeness", kinds=("valid_token_refused", "non_canonical_refused"),
        summary="outlines_core's default whitespace pattern ([ ]?) admits at most one space "
                "between JSON tokens: newlines, tabs, CR and runs of spaces are refused (valid "
                "pretty-printed JSON is refused)",
        repro="person.json, GPT-2: after '{' the token '\\n' (198) is refused; shipped "
              "tokenizer: after '{' the tokens '\\t' (198), '\\r' (202), '  ' (486)",
        matches=lambda r, g: _is_schema_repro(r) and _json_whitespace_beyond_one_space(
            _outside_strings(r.prefix_text, r.added_text or _tok(r) or "")),
        applies_to=_schema_has(lambda n: n.get("type") == "object"),
        probe=Probe(at=lambda s: [i for i in range(1, len(s)) if s[i - 1] in "{,"
                                  and not _inside_json_string(s[:i])],
                    token=lambda t: t in ("\n", "\t", "  "), shows_when_allowed=False)),
    KnownBug(
        id="outlines-core-schema-whitespace-edge", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="tokenizer_edges", kinds=("refused_multi_terminal", "refused_leading_space"),
        summary="the same whitespace restriction, seen on multi-terminal tokens such as '{\\n'",
        repro="person.json, Qwen2.5: token '{\\n' (515) refused at the start",
        matches=lambda r, g: _is_schema_repro(r) and "\n" in (_tok(r) or ""),
        applies_to=_schema_has(lambda n: n.get("type") == "object"),
        expect_reproduced=False),
    _trailing_whitespace_bug("xgrammar", "0.2.9", "XGrammar's JSON-schema grammar",
                             "'\\n', '\\t' and '\\r'"),
    _trailing_whitespace_bug("outlines", "outlines_core 0.2.14",
                             "outlines_core's schema-to-regex", "' ', '\\t' and '\\r'"),
    KnownBug(
        id="outlines-core-regex-leaves-final-state", backend="outlines",
        versions=("outlines_core 0.2.14",),
        check="completeness", kinds=("valid_token_refused", "non_canonical_refused"),
        summary="outlines_core 0.2.14 refuses tokens that leave a final DFA state for a "
                "non-final one (an optional suffix after a complete match; fixed upstream, "
                "unreleased at 0.2.14, docs/design.md)",
        repro="semver.regex, shipped tokenizer: after '7.3' the token '-' is refused though "
              "'7.3-rc1' matches",
        matches=lambda r, g: g is not None and g.format == "regex"
        and _passes_final_state(g.text, r.prefix_text, _tok(r) or ""),
        applies_to=lambda g: g.format == "regex" and "?" in g.text, expect_reproduced=False),
)


def _passes_final_state(pattern: str, prefix: str, token: str) -> bool:
    """Whether the text is a complete match before the token ends (the DFA would leave a
    final state for a non-final one inside or right before this token)."""
    import re

    try:
        rx = re.compile(pattern)
    except re.error:
        return False
    text = prefix + token
    return any(rx.fullmatch(text[:k]) for k in range(len(prefix), len(text)))


def _partial_utf8_bug(backend: str, version: str) -> KnownBug:
    return KnownBug(
        id=f"shim-{backend}-partial-utf8-refused", backend=backend, versions=(version,),
        check="completeness", kinds=("valid_token_refused", "refused_partial_utf8", "non_canonical_refused"),
        summary=f"our shim-{backend} plugin refuses partial-UTF-8 byte tokens inside JSON "
                f"strings where the upstream processor allows them; {_PLUGIN_FIX}",
        repro="json, mistral-v1: after '[\"' the byte token <0xE4> is refused though "
              "'[\"中\"]' is valid",
        matches=lambda r, g: _is_partial_utf8_token(r)
        and _inside_json_string(r.prefix_text) and not _adds_del_or_c1(r),
        applies_to=lambda g: g.format == "json_schema" or g.name.startswith("json"),
        expect_reproduced=False)


#: Plugin bugs keyed by the backend version they were measured at (``Masker.backend_version``).
PLUGIN_BUGS: tuple[KnownBug, ...] = (
    _partial_utf8_bug("syncode", "0.4.16"),
    _partial_utf8_bug("outlines", "outlines_core 0.2.14"),
)


#: Upstream bugs a plugin now works around. Never matched (a recurrence is a failure, not an
#: xfail) and never expected in a cell; kept with their probes, so that a test can replay
#: each one against the plugin and show it gone.
WORKED_AROUND: tuple[KnownBug, ...] = (
    KnownBug(
        id="xgrammar-schema-raw-control-chars", backend="xgrammar", versions=("0.2.9",),
        check="soundness", kinds=("unsound_token",),
        summary="XGrammar's JSON-schema strings admit raw control characters (U+0000-U+001F), "
                "which RFC 8259 forbids unescaped; shim-xgrammar refuses them "
                "(shim_xgrammar.byte_guards)",
        repro="schema conformance/grammars/person.json, GPT-2: after '{\"name\":\"/' the "
              "tokens '\\x1f' (219) and '\\t' (197) are allowed",
        matches=lambda r, g: _is_schema_repro(r) and _inside_json_string(r.prefix_text)
        and any(ord(c) < 0x20 for c in (_tok(r) or "")),
        applies_to=_schema_has(lambda n: n.get("type") == "string" and "enum" not in n
                               and "pattern" not in n),
        probe=Probe(at=lambda s: [i for i in range(1, len(s)) if s[i - 1] == '"'
                                  and _inside_json_string(s[:i])],
                    token=lambda t: len(t) == 1 and ord(t) < 0x20, shows_when_allowed=True)),
)


def known_bugs() -> tuple[KnownBug, ...]:
    return KNOWN_BUGS + PLUGIN_BUGS


def match_known_bug(repro: Repro, backend_version: str, grammar: Grammar | None = None
                    ) -> str | None:
    """The id of the known bug ``repro`` (found on ``grammar``) is an instance of, or None."""
    if grammar is None:
        return None  # the construct a bug needs must be seen in the grammar
    for bug in known_bugs():
        if (_base(repro.backend) == bug.backend and backend_version in bug.versions
                and bug.check == repro.check and repro.kind in bug.kinds
                and bug.applies_to(grammar) and bug.matches(repro, grammar)):
            return bug.id
    return None


def expected_known_bugs(backend: str, backend_version: str, grammar: Grammar) -> list[str]:
    """Known bugs this cell should reproduce (backend, version and construct all present)."""
    return [b.id for b in known_bugs()
            if b.backend == _base(backend) and backend_version in b.versions
            and b.expect_reproduced and b.applies_to(grammar)]


def known_bug(bug_id: str) -> KnownBug:
    for bug in known_bugs() + WORKED_AROUND:
        if bug.id == bug_id:
            return bug
    raise KeyError(f"no known bug {bug_id!r}")


def check_known_ids(ids: "Sequence[str] | str | None") -> tuple[str, ...]:
    """Known bug ids a user acknowledges, checked: an unknown id is a usage error that names
    the ids there are (a typo must not silently accept nothing)."""
    if not ids:
        return ()
    items = [i.strip() for i in (ids.split(",") if isinstance(ids, str) else ids) if i.strip()]
    every = [b.id for b in known_bugs()]
    unknown = [i for i in items if i not in every]
    if unknown:
        raise UnknownKnownBugError(f"no known bug {', '.join(map(repr, unknown))}; known bugs: "
                                   f"{', '.join(every)}")
    return tuple(dict.fromkeys(items))


class UnknownKnownBugError(ValueError):
    """``--accept-known`` named an id that is not a known bug."""


def _base(backend: str) -> str:
    """``xgrammar+fault`` (an injected fault over xgrammar) is still xgrammar."""
    return backend.split("+", 1)[0]
