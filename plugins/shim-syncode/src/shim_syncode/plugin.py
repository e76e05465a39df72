"""Entry point ``shim_adapters: syncode``: registers the SynCode backend.

Registration imports nothing from SynCode (it loads on the first compile), so listing backends
stays cheap and never touches logging.
"""

from __future__ import annotations

from importlib.metadata import version

from shim_adapters.backends import BackendSpec
from shim_adapters.hookspecs import hookimpl
from shim_adapters.protocol import FeatureStatus

from . import BACKEND_NAME

#: Every feature is read from SynCode's own state: the LALR state stack, the mask store's
#: (terminal, DFA state) pairs for the remainder, and ParseResult.remainder.
FEATURE_STATUS = {
    "parser_state": FeatureStatus.EXACT,
    "lexer_state": FeatureStatus.EXACT,
    "partial_lexeme": FeatureStatus.EXACT,
}


def create_masker(grammar, tokenizer, vocab_size=None, **options):
    from .masker import compile_masker

    return compile_masker(grammar, tokenizer, vocab_size, **options)


def _formats() -> tuple[str, ...]:
    try:
        from shim_adapters.grammar_convert import ebnf_to_lark  # noqa: F401
    except ImportError:
        return ("lark",)
    return ("lark", "ebnf")


@hookimpl
def register_backends(register):
    register(BackendSpec(
        name=BACKEND_NAME,
        version=version("syncode"),
        grammar_formats=_formats(),
        feature_status=FEATURE_STATUS,
        create_masker=create_masker,
        native_formats=("lark",),
        description="SynCode 0.4.16: Lark LALR parser + per-terminal DFA mask store "
                    "(grammar_strict), re-lexing only from the last open lexeme",
    ))
