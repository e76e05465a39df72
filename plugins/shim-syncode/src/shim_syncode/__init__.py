"""SynCode backend for shim-adapters: SynCode's LALR parser and DFA mask store as a Masker.

Importing this package does not import SynCode; :func:`shim_syncode.masker.compile_masker`
does, on first use, without touching the host's logging configuration.
"""

__all__ = ["BACKEND_NAME"]

BACKEND_NAME = "syncode"
