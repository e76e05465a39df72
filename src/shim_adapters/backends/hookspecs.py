"""pluggy hook specifications: how a plugin contributes a masker backend.

A plugin module (or object) implements ``register_backends(register)`` and calls
``register(BackendSpec(...))`` once per backend it provides. That is the whole interface.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "shim_adapters"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_backends(register):  # pragma: no cover - specification only
    """Call ``register(spec)`` with a :class:`shim_adapters.backends.spec.BackendSpec` per backend."""
