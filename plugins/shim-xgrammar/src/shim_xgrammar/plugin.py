"""Entry point: registers the ``xgrammar`` backend."""

from __future__ import annotations

from shim_adapters.backends import BackendSpec
from shim_adapters.hookspecs import hookimpl

from .masker import DECLARED_FEATURES, GRAMMAR_FORMATS, XGrammarMasker, xgrammar_version


@hookimpl
def register_backends(register):
    register(BackendSpec(
        name="xgrammar",
        version=xgrammar_version(),
        grammar_formats=GRAMMAR_FORMATS,
        feature_status=DECLARED_FEATURES,
        create_masker=XGrammarMasker,
        description="XGrammar byte-level Earley masks; EBNF, JSON schema, regex natively, "
                    "Lark through shim_adapters.grammar_convert",
    ))
