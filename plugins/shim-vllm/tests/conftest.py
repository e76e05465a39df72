"""Fixtures: vLLM's real config for the shipped tiny LM, and controllers fitted on its tokenizer.

These tests need the environment built by ``plugins/shim-vllm/scripts/make_env.sh`` (vLLM
0.33 beside the shim core); the repo's default test run never collects them.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    raise pytest.UsageError(
        "plugins/shim-vllm/tests need vLLM: build the environment with "
        "plugins/shim-vllm/scripts/make_env.sh and run its python -m pytest")

import torch

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM's real classes (scripts/make_env.sh)")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def lm():
    from shim_adapters.lm.loading import load_lm

    return load_lm(None)


@pytest.fixture
def vllm_config(lm):
    """vLLM's own config for the shipped LM (a GPT-2 architecture vLLM supports).

    A fresh one per test: an engine (config) gets one active SHIM processor.
    """
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    from shim_adapters.lm.loading import default_lm_path

    model_config = ModelConfig(model=str(default_lm_path()), tokenizer=str(default_lm_path()),
                               dtype="float32", seed=0)
    # device "auto" finds no platform on a machine without a GPU; the processor only reads
    # the model config (tokenizer, logits width)
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))


def _fit(lm, grammar_name: str, directory):
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.shim.fitting import fit_controller

    masker = get_backend("xgrammar").compile(builtin_grammar(grammar_name), lm.tokenizer,
                                             lm.vocab_size)
    controller, manifest = fit_controller(lm, masker, kind="LR_FULL", n_samples=200, seed=0,
                                          output_dir=directory, progress=False)
    return directory


@pytest.fixture(scope="session")
def binary5_dir(lm, tmp_path_factory):
    return _fit(lm, "binary5", tmp_path_factory.mktemp("binary5-controller"))


@pytest.fixture(scope="session")
def bv4_dir(lm, tmp_path_factory):
    return _fit(lm, "bv4", tmp_path_factory.mktemp("bv4-controller"))
