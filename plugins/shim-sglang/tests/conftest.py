"""Fixtures: the shipped tiny LM and XGrammar controllers fitted on its tokenizer.

Needs the environment of ``plugins/shim-sglang/scripts/make_env.sh``; the repo's default test
run never collects these tests.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    raise pytest.UsageError("plugins/shim-sglang/tests need SGLang: build the environment with "
                            "plugins/shim-sglang/scripts/make_env.sh and run its python -m pytest")

import torch

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "sglang: needs SGLang's real classes (scripts/make_env.sh)")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.sglang)


@pytest.fixture(scope="session")
def lm():
    from shim_adapters.lm.loading import load_lm

    return load_lm(None)


def _fit(lm, grammar_name, directory):
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.shim.fitting import fit_controller

    masker = get_backend("xgrammar").compile(builtin_grammar(grammar_name), lm.tokenizer,
                                             lm.vocab_size)
    fit_controller(lm, masker, kind="LR_FULL", n_samples=200, seed=0, output_dir=directory,
                   progress=False)
    return directory


@pytest.fixture(scope="session")
def binary5_dir(lm, tmp_path_factory):
    return _fit(lm, "binary5", tmp_path_factory.mktemp("binary5-controller"))


@pytest.fixture(scope="session")
def bv4_dir(lm, tmp_path_factory):
    return _fit(lm, "bv4", tmp_path_factory.mktemp("bv4-controller"))
