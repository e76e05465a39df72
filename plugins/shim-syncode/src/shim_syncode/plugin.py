"""Entry point ``shim_adapters: syncode``: registers the SynCode backend.

Registration imports nothing from SynCode (it loads on the first compile), so listing backends
stays cheap and never touches logging.
"""

from __future__ import annotations

from importlib.metadata import version

from shim_adapters.backends.hookspecs import hookimpl
from shim_adapters.backends.spec import BackendSpec

from . import BACKEND_NAME, FEATURE_STATUS


def create_masker(grammar, tokenizer, vocab_size=None, **options):
    # Deferred: the masker module imports SynCode, which listing backends must not load.
    from .masker import compile_masker

    return compile_masker(grammar, tokenizer, vocab_size, **options)


def _formats() -> tuple[str, ...]:
    try:
        from shim_adapters.grammars.convert import ebnf_to_lark  # noqa: F401
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
