"""Backends: how maskers are found and described.

A backend is a pluggy plugin (:mod:`.hookspecs`) that registers a :class:`~.spec.BackendSpec`;
:mod:`.registry` loads the entry points and answers :func:`get_backend`.

Layer: imports the mask layer and below.
"""

from shim_adapters.backends.registry import backends, get_backend
from shim_adapters.backends.spec import BackendSpec

__all__ = ["BackendSpec", "backends", "get_backend"]
