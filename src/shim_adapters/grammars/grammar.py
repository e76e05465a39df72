"""Grammars: the text a backend compiles, its format, and the built-in set.

A :class:`Grammar` is plain data (text + format + name). Backends decide which formats they
take (``Masker.grammar_formats``); :mod:`shim_adapters.grammars.convert` lowers between Lark and
EBNF/GBNF where that is faithful.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from shim_adapters.errors import GrammarError

#: Formats a grammar can be written in. ``ebnf`` is the GBNF dialect of llama.cpp / XGrammar.
GRAMMAR_FORMATS = ("lark", "ebnf", "json_schema", "regex")

_SUFFIX_FORMATS = {
    ".lark": "lark",
    ".ebnf": "ebnf",
    ".gbnf": "ebnf",
    ".json": "json_schema",
    ".regex": "regex",
    ".re": "regex",
}


@dataclass(frozen=True)
class Grammar:
    """One grammar: its source text, its format and a display name."""

    text: str
    format: str
    name: str = "<grammar>"
    #: The prompt the shipped LM was trained to answer with this grammar's language.
    default_prompt: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.format not in GRAMMAR_FORMATS:
            raise GrammarError(f"unknown grammar format {self.format!r}; expected one of "
                               f"{', '.join(GRAMMAR_FORMATS)}", grammar_name=self.name)
        if not self.text.strip():
            raise GrammarError("grammar is empty", grammar_name=self.name, line=1)

    @property
    def sha256(self) -> str:
        """Content hash of format + text: the grammar's identity in manifests and caches."""
        return hashlib.sha256(f"{self.format}\n{self.text}".encode()).hexdigest()


@dataclass(frozen=True)
class BuiltinGrammar:
    name: str
    filename: str
    prompt: str
    description: str


#: Built-in grammars, each with the prompt the shipped LM answers in its domain.
BUILTIN_GRAMMARS: dict[str, BuiltinGrammar] = {
    g.name: g
    for g in (
        BuiltinGrammar("bv4", "bv4.lark", "Write a 4-bit bit-vector invariant:\n",
                       "SyGuS BV4-style bit-vector s-expressions (define-fun inv ...)"),
        BuiltinGrammar("binary5", "binary5.lark", "Generate a binary string of length 5:\n",
                       "17 of the 32 binary strings of length 5 (docs/design.md)"),
        BuiltinGrammar("json", "json.lark", "Generate a JSON object:\n",
                       "JSON with explicit whitespace"),
        BuiltinGrammar("sql", "sql.lark", "Write a SQL query:\n",
                       "a SELECT subset of SQL ending in ';'"),
    )
}


def builtin_grammar(name: str) -> Grammar:
    """Load a built-in grammar by name (``bv4``, ``binary5``, ``json``, ``sql``)."""
    try:
        spec = BUILTIN_GRAMMARS[name]
    except KeyError:
        raise GrammarError(f"no built-in grammar named {name!r}; built-ins are "
                           f"{', '.join(BUILTIN_GRAMMARS)}", grammar_name=name) from None
    text = resources.files("shim_adapters.grammars").joinpath(spec.filename).read_text()
    return Grammar(text=text, format="lark", name=name, default_prompt=spec.prompt)


def load_grammar(spec: str | Path, format: str | None = None) -> Grammar:
    """A built-in name, or a file whose suffix gives the format (or pass ``format``)."""
    if isinstance(spec, str) and spec in BUILTIN_GRAMMARS:
        return builtin_grammar(spec)
    path = Path(spec)
    if not path.is_file():
        raise GrammarError(f"not a built-in grammar ({', '.join(BUILTIN_GRAMMARS)}) and no "
                           f"such file", grammar_name=str(spec))
    fmt = format or _SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise GrammarError(f"cannot tell the grammar format from suffix {path.suffix!r}; pass "
                           f"format= one of {', '.join(GRAMMAR_FORMATS)}", grammar_name=str(path))
    text = path.read_text()
    if fmt == "regex":
        text = _without_final_newline(text)
    return Grammar(text=text, format=fmt, name=path.name)


def _without_final_newline(text: str) -> str:
    """A ``.regex`` file means its content without the final newline: an editor adds one, and
    a pattern that needs a trailing newline writes ``\\n``. Every command reads it this way."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text
