"""Import SynCode without letting it rewire the host's logging.

``syncode/__init__.py`` calls ``common.setup_logging()``, which removes every root handler,
installs a stdout handler and sets the root level to INFO. We snapshot the root logger before
the first import and put it back afterwards, so a host application's logging is unchanged.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}

#: The SynCode modules the backend uses (the package __init__ runs on the first of them).
_MODULES = (
    "syncode.mask_store.mask_store",
    "syncode.mask_store.fsm_set",
    "syncode.mask_store.byte_tokenizer",
    "syncode.parsers",
    "syncode.parsers.incremental_parser",
    "syncode.parsers.grammars.grammar",
    "syncode.parse_result",
    "syncode.larkm",
    "syncode.larkm.lexer",
    "syncode.larkm.exceptions",
    "syncode.larkm.parsers.lalr_analysis",
)


def syncode_modules() -> dict[str, ModuleType]:
    """The SynCode modules by dotted name, imported once with the root logger preserved."""
    with _lock:
        if not _loaded:
            root = logging.getLogger()
            handlers, level, disabled = list(root.handlers), root.level, root.disabled
            try:
                for name in _MODULES:
                    _loaded[name] = importlib.import_module(name)
            finally:
                root.handlers[:] = handlers
                root.setLevel(level)
                root.disabled = disabled
        return _loaded


def syncode_version() -> str:
    from importlib.metadata import version

    return version("syncode")
