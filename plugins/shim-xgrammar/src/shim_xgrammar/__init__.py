"""XGrammar masker backend for shim-adapters (entry point ``xgrammar``)."""

from .internal_state import EarleyItem, InternalState, parse_internal_state
from .masker import XGrammarMasker, XGrammarState

__all__ = ["EarleyItem", "InternalState", "XGrammarMasker", "XGrammarState",
           "parse_internal_state"]
