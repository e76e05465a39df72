"""Shared fixtures: the shipped LM (loaded once) and the example plugin from docs/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shipped_lm():
    from shim_adapters.lm import load_lm

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
    from shim_adapters.plugins import register_plugin, unregister_plugin

    spec = importlib.util.spec_from_file_location("shim_choices_example",
                                                  ROOT / "docs" / "example_plugin.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    register_plugin(module, name="choices-example")
    yield module
    unregister_plugin(module)
