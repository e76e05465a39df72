"""Conformance: does a masker, compiled for *your* tokenizer and grammar, keep its promises?

Checks (each with counts and, on failure, a minimised repro: grammar, prefix text, token id
and token text): soundness, completeness (canonical and non-canonical tokenizations), no dead
ends (no allowed token without a finite completion), tokenizer edge cases, chat-template
control tokens, γ behaviour, an exhaustive whole-vocabulary mask check per state, and a
differential comparison across backends. The exit status fails closed: the OR of the failing
classes' bits (1 soundness, 2 completeness, 4 dead ends, 8 errors, 16 control tokens). Every
verdict comes from references independent of the backends (:mod:`shim_adapters.grammars.reference`,
:mod:`.prefix`). See ``conformance/README.md`` for the CI recipe.

    from shim_adapters.conformance import run_conformance
    report = run_conformance("xgrammar", "gpt2", "json", profile="fast")
    print(report.to_markdown()); raise SystemExit(report.exit_code)
"""

from shim_adapters.conformance.profiles import PROFILES, Profile, get_profile
from shim_adapters.conformance.report import (
           CellResult,
           CheckResult,
           DifferentialResult,
           Report,
           Repro,
)
from shim_adapters.conformance.runner import (
           resolve_tokenizer,
           run_conformance,
           run_matrix,
           run_profile_file,
)

__all__ = ["PROFILES", "CellResult", "CheckResult", "DifferentialResult", "Profile", "Report",
           "Repro", "get_profile", "resolve_tokenizer", "run_conformance", "run_matrix",
           "run_profile_file"]
