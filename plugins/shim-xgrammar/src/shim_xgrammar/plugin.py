"""Entry point: registers the ``xgrammar`` backend."""

from __future__ import annotations

from shim_adapters.backends.hookspecs import hookimpl
from shim_adapters.backends.spec import BackendSpec

from .masker import DECLARED_FEATURES, GRAMMAR_FORMATS, XGrammarMasker, xgrammar_version

#: JSON-schema constructs as measured by shim_adapters.mask.capability.probe_schema_support
#: (tests/test_capability.py checks this table against the backend): XGrammar 0.2.9 compiles
#: but does not enforce the post-check ones (oneOf is enforced as anyOf).
_EXACT = ("type", "enum", "const", "properties", "required", "additionalProperties", "items",
          "minItems", "maxItems", "minLength", "maxLength", "pattern", "anyOf", "$ref",
          "minimum", "maximum", "multipleOf", "minProperties", "maxProperties")
_POST_CHECK = ("not", "dependentRequired", "uniqueItems", "if", "then", "else",
               "pattern:lookaround", "oneOf")
SCHEMA_SUPPORT = {**{k: "exact" for k in _EXACT}, **{k: "post-check" for k in _POST_CHECK},
                  # XGrammar enforces multipleOf on integers only ("multipleOf is not
                  # supported for type:number; ignoring multipleOf"): 0.01 accepts 10000.001
                  "multipleOf:non-integer": "post-check",
                  # ... and not on type number even with an integer step: 1.0 accepts 1.5
                  "multipleOf:number": "post-check",
                  # anyOf beside other keywords compiles its branches alone, dropping the
                  # siblings (docs/upstream-reports.md): {"a": "x"} passes properties a:integer
                  "anyOf:with-siblings": "post-check",
                  # "pattern combined with minLength/maxLength is not supported; ignoring
                  # minLength/maxLength": the pattern holds, the length bound does not
                  "pattern:with-length": "exact",
                  "length:with-pattern": "post-check",
                  # "format combined with minLength/maxLength is not supported" likewise, and
                  # a pattern beside a format is dropped without a warning
                  "length:with-format": "post-check",
                  "pattern:with-format": "post-check",
                  # "range + multipleOf combination not yet supported; ignoring multipleOf":
                  # a step is kept only in a short range bounded on both sides (enumerated),
                  # dropped beside a one-sided or a wide range
                  "multipleOf:with-bound": "post-check",
                  # a required member the schema does not list is dropped from the object
                  # (MaskBench Github_trivial---o90933 accepts {"a": ..., "b": ...} without
                  # its required "<caret>")
                  "required:unlisted": "post-check",
                  # "Anchor '$' in the middle of regex is ignored": ^a$b? accepts "ab"
                  "pattern:inner-anchor": "post-check",
                  # a pattern is matched whole, not searched: valid strings refused
                  "pattern:unanchored": "stricter",
                  # compile_json_schema's strict_mode (on by default, kept here) refuses members
                  # a schema does not list where it says nothing about additionalProperties:
                  # valid instances refused, never an invalid one accepted
                  "additionalProperties:absent": "stricter",
                  "schema:any": "exact"}


@hookimpl
def register_backends(register):
    register(BackendSpec(
        name="xgrammar",
        version=xgrammar_version(),
        grammar_formats=GRAMMAR_FORMATS,
        feature_status=DECLARED_FEATURES,
        create_masker=XGrammarMasker,
        description="XGrammar byte-level Earley masks; EBNF, JSON schema, regex natively, "
                    "Lark through shim_adapters.grammars.convert",
        schema_support=SCHEMA_SUPPORT,
        native_formats=("ebnf", "json_schema", "regex"),
    ))
