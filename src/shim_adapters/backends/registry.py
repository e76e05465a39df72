"""The plugin manager: installed entry points in group ``shim_adapters``, plus test plugins."""

from __future__ import annotations

import pluggy

from shim_adapters.backends import hookspecs
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.errors import BackendNotFoundError

ENTRY_POINT_GROUP = "shim_adapters"

_pm: pluggy.PluginManager | None = None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, with every installed plugin loaded once."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        _pm = pm
    return _pm


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object or module directly (tests, notebooks, unpublished maskers)."""
    plugin_manager().register(plugin, name=name)


def unregister_plugin(plugin: object) -> None:
    plugin_manager().unregister(plugin)


def backends() -> dict[str, BackendSpec]:
    """Every registered backend by name; two plugins claiming one name is an error."""
    found: dict[str, BackendSpec] = {}

    def register(spec: BackendSpec) -> None:
        if spec.name in found:
            raise ValueError(f"two plugins register a backend named {spec.name!r}")
        found[spec.name] = spec

    plugin_manager().hook.register_backends(register=register)
    return dict(sorted(found.items()))


def get_backend(name: str) -> BackendSpec:
    available = backends()
    try:
        return available[name]
    except KeyError:
        raise BackendNotFoundError(
            f"no backend named {name!r} is installed; installed: "
            f"{', '.join(available) or 'none'} (pip install plugins/shim-{name})") from None
