"""Shared fixtures: the shipped LM (loaded once), the example plugin from docs/, and the
benchmark data (BV4, Spider), which is not part of the repository.

Tests that read the benchmark data carry the ``benchmark_data`` marker and take its location
from ``--benchmark-data DIR`` or ``SHIM_BENCHMARK_DATA``; without either they are skipped with
that reason and the run's summary says how many and why (a fresh clone passes; ``.ci/run`` sets
the variable when ``../shared/benchmarks`` is beside the checkout)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from shim_adapters.errors import BackendNotFoundError

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

BENCHMARK_ENV = "SHIM_BENCHMARK_DATA"
NO_BENCHMARK_DATA = (f"needs the benchmark data: pass --benchmark-data DIR or set {BENCHMARK_ENV} "
                     "(the directory holding BV4/, spider/, example/)")


def pytest_addoption(parser):
    parser.addoption("--benchmark-data", metavar="DIR", default=os.environ.get(BENCHMARK_ENV),
                     help="Directory of the benchmark data (BV4/, spider/, example/); default "
                          f"${BENCHMARK_ENV}. Tests marked benchmark_data are skipped without it.")


def _benchmark_dir(config) -> Path | None:
    value = config.getoption("--benchmark-data")
    return Path(value).expanduser().resolve() if value else None


def pytest_configure(config):
    config.addinivalue_line("markers", "benchmark_data: reads the BV4/Spider benchmark data "
                                       "(--benchmark-data DIR or SHIM_BENCHMARK_DATA)")
    path = _benchmark_dir(config)
    if path is not None and not path.is_dir():
        raise pytest.UsageError(f"--benchmark-data / {BENCHMARK_ENV}: {path} is not a directory")


def pytest_collection_modifyitems(config, items):
    if _benchmark_dir(config) is not None:
        return
    skip = pytest.mark.skip(reason=NO_BENCHMARK_DATA)
    for item in items:
        if item.get_closest_marker("benchmark_data") is not None:
            item.add_marker(skip)


#: How the backend registry names the backend it could not find.
_MISSING_BACKEND = re.compile(r"no backend named '([^']+)' is installed")


def _installed_backend_plugins() -> set[str]:
    return {ep.name for ep in importlib.metadata.entry_points(group="shim_adapters")}


def _missing_backend(exc: BaseException) -> str | None:
    """The backend an exception says is missing: the registry's error, or an import of a
    backend plugin's package (``shim_<name>``) or of the backend library itself."""
    if isinstance(exc, BackendNotFoundError):
        found = _MISSING_BACKEND.search(str(exc))
        return found.group(1) if found else None
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        name = top[len("shim_"):] if top.startswith("shim_") else top
        return name if (ROOT / "plugins" / f"shim-{name}").is_dir() else None
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that asks for a backend whose plugin is not installed is skipped, naming it.

    SynCode pins transformers 4.53.2, so a transformers-5 environment runs the suite without
    shim-syncode; its tests then say why they did not run instead of erroring. A plugin that is
    installed but fails to load still errors."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.excinfo is None:
        return
    name = _missing_backend(call.excinfo.value)
    if name is None or name in _installed_backend_plugins():
        return
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0,
                       f"Skipped: backend {name!r} is not installed (pip install "
                       f"plugins/shim-{name})")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say what this run did not run and why (deselected markers, missing benchmark data)."""
    notes = []
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if getattr(r, "longrepr", None) and NO_BENCHMARK_DATA in str(r.longrepr)]
    if skipped:
        notes.append(f"{len(skipped)} benchmark_data tests skipped: {NO_BENCHMARK_DATA}")
    deselected = len(terminalreporter.stats.get("deselected", []))
    filters = [f"{opt} {config.getoption(opt)!r}" for opt in ("-m", "-k")
               if config.getoption(opt)]
    if deselected and filters:
        hint = " (the slow ones run with -m slow)" if "slow" in str(config.getoption("-m")) else ""
        notes.append(f"{deselected} tests deselected by {' and '.join(filters)}{hint}")
    if notes:
        terminalreporter.write_sep("-", "not run")
        for note in notes:
            terminalreporter.write_line(note)


@pytest.fixture(scope="session")
def benchmark_data(request) -> Path:
    """The benchmark data directory; only tests marked ``benchmark_data`` may ask for it."""
    path = _benchmark_dir(request.config)
    if path is None:  # a test that asks for it without the marker is a bug in the test
        raise RuntimeError("a test uses the benchmark_data fixture without the benchmark_data marker")
    return path


@pytest.fixture(scope="session", autouse=True)
def _private_compile_cache(tmp_path_factory):
    """Compiled grammars go to a per-run cache, never the user's ~/.cache."""
    if "SHIM_CACHE_DIR" not in os.environ:
        os.environ["SHIM_CACHE_DIR"] = str(tmp_path_factory.mktemp("compile-cache"))
        yield
        del os.environ["SHIM_CACHE_DIR"]
    else:
        yield


@pytest.fixture(scope="session")
def shipped_lm():
    from shim_adapters.lm.loading import load_lm

    return load_lm(None)


@pytest.fixture(scope="session")
def lm(shipped_lm):
    """The shipped LM, loaded once per session (tests that fit controllers share it)."""
    return shipped_lm


@pytest.fixture(scope="module")
def example_plugin():
    """docs/example_plugin.py, imported as a module and registered directly with pluggy.

    Module-scoped: it is unregistered after the module, so suites that run over "every
    installed backend" (contract, conformance) see only the installed plugins."""
    from shim_adapters.backends.registry import register_plugin, unregister_plugin

    spec = importlib.util.spec_from_file_location("shim_choices_example",
                                                  ROOT / "docs" / "example_plugin.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    register_plugin(module, name="choices-example")
    yield module
    unregister_plugin(module)
