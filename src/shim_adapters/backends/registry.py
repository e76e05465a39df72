"""The plugin manager: installed entry points in group ``shim_adapters``, plus test plugins."""

from __future__ import annotations

import importlib.metadata

import pluggy

from shim_adapters.backends import hookspecs
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.errors import BackendNotFoundError

ENTRY_POINT_GROUP = "shim_adapters"

_pm: pluggy.PluginManager | None = None
#: Entry points that failed to load: entry point name -> "distribution: error".
_broken: dict[str, str] = {}


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, with every installed plugin loaded once. A plugin whose
    entry point fails to import is recorded (:func:`broken_plugins`) and left out: the other
    backends keep working."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        _load_entry_points(pm)
        _pm = pm
    return _pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """``pm.load_setuptools_entrypoints`` one entry point at a time: pluggy's raises on the
    first plugin that fails to import and loads none of the rest."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure of a third-party plugin
            _broken[ep.name] = f"{dist}: {type(exc).__name__}: {exc}"
            continue
        pm.register(plugin, name=ep.name)


def broken_plugins() -> dict[str, str]:
    """Installed plugins whose entry point failed to import: name -> "distribution: error"."""
    plugin_manager()
    return dict(_broken)


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
        broken = broken_plugins()
        if name in broken:
            raise BackendNotFoundError(
                f"the plugin providing backend {name!r} is installed but failed to import "
                f"({broken[name]}); installed and working: {', '.join(available) or 'none'}"
            ) from None
        raise BackendNotFoundError(
            f"no backend named {name!r} is installed; installed: "
            f"{', '.join(available) or 'none'}. {_install_hint(name)}") from None


#: The backends whose plugins ship in this repository, by name.
_SHIPPED_PLUGINS = {"syncode": "plugins/shim-syncode", "xgrammar": "plugins/shim-xgrammar",
                    "outlines": "plugins/shim-outlines"}


def _install_hint(name: str) -> str:
    if name in _SHIPPED_PLUGINS:
        return (f"Its plugin ships with shim-adapters: pip install -e "
                f"{_SHIPPED_PLUGINS[name]} (from a checkout of the repository)")
    return (f"No plugin shipped with shim-adapters is named {name!r}: a backend is a "
            f"distribution with an entry point in the group {ENTRY_POINT_GROUP!r} (see the "
            f"README, 'Adding a masker')")
