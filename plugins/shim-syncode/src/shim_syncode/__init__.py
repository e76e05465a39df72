"""SynCode backend for shim-adapters: SynCode's LALR parser and DFA mask store as a Masker.

Importing this package does not import SynCode; :func:`shim_syncode.masker.compile_masker`
does, on first use, without touching the host's logging configuration.
"""

from shim_adapters.mask.protocol import FeatureStatus

__all__ = ["BACKEND_NAME", "FEATURE_STATUS"]

BACKEND_NAME = "syncode"

#: Every feature is read from SynCode's own state: the LALR state stack, the mask store's
#: (terminal, DFA state) pairs for the remainder, and ParseResult.remainder.
FEATURE_STATUS = {
    "parser_state": FeatureStatus.EXACT,
    "lexer_state": FeatureStatus.EXACT,
    "partial_lexeme": FeatureStatus.EXACT,
}
