"""Grammars: what a masker enforces, independent of any backend.

:class:`Grammar` and the built-ins (``*.lark`` beside this file), Lark <-> EBNF conversion
(:mod:`.convert`), explicit grammar transforms (:mod:`.transforms`) and the reference acceptors
that every verdict in tests and conformance comes from (:mod:`.reference`).

Layer: the bottom of the house above :mod:`shim_adapters.errors`; imports nothing else of the
project.
"""

from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, Grammar, builtin_grammar, load_grammar

__all__ = ["BUILTIN_GRAMMARS", "Grammar", "builtin_grammar", "load_grammar"]
