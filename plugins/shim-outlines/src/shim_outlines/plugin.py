"""Registers the ``outlines`` backend: the engines outlines 1.3 itself dispatches to.

Regex and JSON schema go to outlines_core (exact DFA state); Lark and EBNF grammars go to
llguidance (features derived by a shadow LALR parser). ``create_masker`` picks by format.
"""

from __future__ import annotations

from importlib.metadata import version

from shim_adapters.backends.hookspecs import hookimpl
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.errors import UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.protocol import Masker

from .cfg_masker import DERIVED_STATUS, LLGuidanceMasker
from .regex_masker import FEATURE_STATUS as REGEX_FEATURE_STATUS
from .regex_masker import OutlinesCoreMasker

GRAMMAR_FORMATS = ("lark", "ebnf", "regex", "json_schema")

#: JSON-schema constructs as measured by shim_adapters.mask.capability.probe_schema_support
#: (tests/test_capability.py checks this table against the backend): outlines_core 0.2.14
#: lowers a schema to a regex and drops the post-check ones (oneOf becomes anyOf); a
#: lookaround in ``pattern`` does not compile.
_EXACT = ("type", "enum", "const", "properties", "required", "additionalProperties", "items",
          "minItems", "maxItems", "minLength", "maxLength", "pattern", "anyOf", "$ref")
_POST_CHECK = ("minimum", "maximum", "multipleOf", "minProperties", "maxProperties", "not",
               "dependentRequired", "uniqueItems", "if", "then", "else", "oneOf")
SCHEMA_SUPPORT = {**{k: "exact" for k in _EXACT}, **{k: "post-check" for k in _POST_CHECK},
                  "pattern:lookaround": "rejected",
                  # measured: the probe's valid and invalid numbers are both refused
                  "multipleOf:non-integer": "stricter",
                  "multipleOf:number": "exact",
                  "anyOf:with-siblings": "exact",
                  # a pattern beside minLength/maxLength: the length holds, the pattern does
                  # not (MaskBench Github_easy---o50679: "ABC1@3" through ^[\+\w-]{5,96}$)
                  "pattern:with-length": "post-check",
                  "length:with-pattern": "exact",
                  # beside a format the length holds (the format, post-check everywhere, does
                  # not); a pattern beside a format does not compile
                  "length:with-format": "exact",
                  "pattern:with-format": "rejected",
                  "multipleOf:with-bound": "post-check",
                  # a required member the schema does not list is dropped from the object
                  "required:unlisted": "post-check",
                  # an anchor inside a pattern does not compile (or, inside a group, is
                  # matched more strictly)
                  "pattern:inner-anchor": "rejected",
                  # a pattern is matched whole, not searched: valid strings refused
                  "pattern:unanchored": "stricter",
                  # outlines_core, like XGrammar's strict_mode, refuses members a schema does
                  # not list where it says nothing about additionalProperties
                  "additionalProperties:absent": "stricter",
                  # outlines_core splices "any value" ({}) in as an unbracketed alternation
                  # that breaks the object around it (docs/upstream-reports.md): invalid
                  # output gets through, valid output is refused
                  "schema:any": "post-check"}


def create_masker(grammar: Grammar, tokenizer, vocab_size: int | None = None,
                  **options) -> Masker:
    """Compile ``grammar`` with the engine outlines uses for its format.

    Options: ``eos_token_ids``; ``whitespace_pattern`` (JSON schema); ``shadow_parser``
    (CFGs, default True); ``mask_cache_size`` (regex/JSON).
    """
    if grammar.format in OutlinesCoreMasker.grammar_formats:
        return OutlinesCoreMasker(grammar, tokenizer, vocab_size, **options)
    if grammar.format in LLGuidanceMasker.grammar_formats:
        return LLGuidanceMasker(grammar, tokenizer, vocab_size, **options)
    raise UnsupportedGrammarError(f"the outlines backend takes {', '.join(GRAMMAR_FORMATS)}, "
                                  f"not {grammar.format!r}", grammar_name=grammar.name)


def backend_spec() -> BackendSpec:
    regex_status = ", ".join(f"{k} {v.value}" for k, v in REGEX_FEATURE_STATUS.items())
    return BackendSpec(
        name="outlines",
        version=f"outlines_core {version('outlines_core')}; llguidance {version('llguidance')}",
        grammar_formats=GRAMMAR_FORMATS,
        # The CFG engine's status (llguidance + shadow parser); regex and JSON schema go to
        # outlines_core, which reads the DFA state exactly and has no parser state.
        feature_status=dict(DERIVED_STATUS),
        feature_status_by_format={f: dict(REGEX_FEATURE_STATUS)
                                  for f in OutlinesCoreMasker.grammar_formats},
        create_masker=create_masker,
        schema_support=SCHEMA_SUPPORT,
        native_formats=("lark", "regex", "json_schema"),
        description=("outlines' engines: regex/json_schema via outlines_core (DFA state; "
                     f"{regex_status}); "
                     "lark/ebnf via llguidance (all three features derived by a shadow Lark "
                     "LALR parser, or missing if the grammar is not LALR(1))"),
    )


@hookimpl
def register_backends(register):
    register(backend_spec())
