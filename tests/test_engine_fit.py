"""Engine rollouts without an engine: the replay, the resumable store, the masking artefact and
the refusals that come before any rollout. (The fit against a real vLLM server is in
test_engine_fit_engine.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from shim_adapters.backends import get_backend
from shim_adapters.cli import main
from shim_adapters.grammars import builtin_grammar
from shim_adapters.lm.engine_client import EngineClient, EngineUnavailableError
from shim_adapters.shim.artefact import load_controller
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.engine_fit import EngineLM, local_tokenizer, write_masking_artefact
from shim_adapters.shim.engine_rollouts import (
    CollectionMismatchError,
    EngineRecord,
    EngineReplayError,
    EngineSettings,
    RolloutStore,
    replay_rollouts,
    rollout_seed,
)
from shim_adapters.shim.training_data import sample_training_data


@pytest.fixture(scope="module")
def masker(lm):
    return get_backend("xgrammar").compile(builtin_grammar("binary5"), lm.tokenizer,
                                           lm.vocab_size)


@pytest.fixture(scope="module")
def in_process(lm, masker):
    """Masked rollouts of the in-process engine, every allowed token stored."""
    return sample_training_data(lm, masker, masker.grammar.default_prompt, 40,
                                proposal="masked", seed=3, progress=False,
                                allowed_min_prob=None)


def as_engine_records(data) -> list[EngineRecord]:
    """What an engine returns for these rollouts: per step log q of the sampled token, log p,
    and the masked distribution's top alternatives (here all of them)."""
    records = []
    for i in range(data.n_completions):
        rows = np.flatnonzero(data.row_completion == i)
        top = []
        for r in rows:
            ids, lps = data.allowed(r)
            top.append({int(a): float(b - data.row_log_z[r]) for a, b in zip(ids, lps)})
        records.append(EngineRecord(
            index=i, seed=rollout_seed(3, i), engine="http://127.0.0.1:0",
            token_ids=[int(t) for t in data.completion_tokens(i)],
            proposal_logprobs=[float(x) for x in data.row_proposal_logprob[rows]],
            lm_logprobs=[float(x) for x in data.row_lm_logprob[rows]], top=top,
            finish_reason="stop"))
    return records


def replay(records, masker, lm, **settings):
    return replay_rollouts(records, masker, prompt=masker.grammar.default_prompt,
                           eos=masker.eos_token_ids, seed=3,
                           settings=EngineSettings(allowed_min_prob=None, **settings),
                           lm_fields={"lm_identifier": lm.identifier,
                                      "lm_revision": lm.revision}, engine={})


def test_replayed_engine_rollouts_are_the_in_process_training_data(lm, masker, in_process):
    replayed = replay(as_engine_records(in_process), masker, lm)
    for name in ("row_completion", "row_step", "row_state", "row_token", "valid",
                 "allowed_offsets", "allowed_token_ids", "completion_token_ids"):
        assert np.array_equal(getattr(replayed, name), getattr(in_process, name)), name
    for name in ("row_lm_logprob", "row_proposal_logprob", "row_log_z", "allowed_lm_logprobs",
                 "row_label"):
        np.testing.assert_allclose(getattr(replayed, name), getattr(in_process, name),
                                   atol=1e-6, err_msg=name)
    assert replayed.states == in_process.states
    assert replayed.manifest["sampling"]["proposal"] == "masked"


def test_a_top_k_engine_keeps_log_z_exact_and_the_top_of_the_allowed_set(lm, masker,
                                                                          in_process):
    records = as_engine_records(in_process)
    for rec in records:  # an engine that returns only the best alternative per step
        for step in rec.top:
            best = max(step, key=step.get)
            for k in [k for k in step if k != best]:
                del step[k]
    replayed = replay(records, masker, lm)
    np.testing.assert_allclose(replayed.row_log_z, in_process.row_log_z, atol=1e-6)
    sizes = np.diff(replayed.allowed_offsets)
    assert sizes.max() <= 2 and sizes.min() >= 1  # the best one, and the sampled token


def test_a_token_the_masker_forbids_is_refused_on_replay(lm, masker, in_process):
    records = as_engine_records(in_process)[:2]
    forbidden = int(np.flatnonzero(~masker.new_state().allowed_mask())[0])
    bad = records[1]
    records[1] = EngineRecord(bad.index, bad.seed, bad.engine, [forbidden] + bad.token_ids[1:],
                              bad.proposal_logprobs, bad.lm_logprobs, bad.top,
                              bad.finish_reason)
    with pytest.raises(EngineReplayError, match=f"rollout 1 .*token {forbidden}"):
        replay(records, masker, lm)


def test_a_killed_collection_resumes_with_its_finished_rollouts(tmp_path, lm, masker,
                                                                in_process):
    records = as_engine_records(in_process)[:5]
    header = {"model": {"id": "m", "root": "/m"}, "seed": 3, "sampling": {"top_logprobs": 20}}
    path = tmp_path / "rollouts.jsonl"
    store = RolloutStore(path, header)
    for rec in records[:3]:
        store.append(rec)
    with path.open("a") as fh:  # a writer killed in the middle of the fourth line
        fh.write(records[3].to_json()[:25])
    resumed = RolloutStore(path, header)
    assert sorted(resumed.records) == [0, 1, 2]
    assert resumed.records[2] == records[2]
    assert path.read_text().endswith("\n")
    resumed.append(records[3])
    assert sorted(RolloutStore(path, header).records) == [0, 1, 2, 3]
    with pytest.raises(CollectionMismatchError, match="seed"):
        RolloutStore(path, {**header, "seed": 4})


def test_rollout_seeds_depend_on_the_draw_and_index_only():
    assert rollout_seed(0, 5) == rollout_seed(0, 5)
    assert len({rollout_seed(s, i) for s in range(3) for i in range(100)}) == 300


def test_the_masking_artefact_masks_only(tmp_path, lm, masker):
    directory = write_masking_artefact(tmp_path / "mask", masker,
                                       EngineLM(lm.identifier, lm.revision))
    controller, manifest = load_controller(directory, masker, lm)
    assert controller.beta_ == 0.0
    assert ShimAdjuster(controller).inert
    assert "masking artefact" in manifest["training"]["purpose"]


def test_the_local_tokenizer_is_the_shipped_lms(lm):
    local = local_tokenizer("default")
    assert local.vocab_size == lm.vocab_size
    assert local.tokenizer("0101")["input_ids"] == lm.tokenizer("0101")["input_ids"]


def test_an_engine_that_cannot_be_reached_is_refused_before_any_rollout(tmp_path):
    with pytest.raises(EngineUnavailableError, match="cannot be reached"):
        EngineClient("http://127.0.0.1:9", timeout=5).served_model()
    out = tmp_path / "fit"
    result = CliRunner().invoke(main, ["fit", "--grammar", "binary5", "--backend", "xgrammar",
                                       "--engine", "http://127.0.0.1:9", "--out", str(out)])
    assert result.exit_code != 0
    assert "cannot be reached" in result.output
    assert not (out / "engine-rollouts").exists()
    assert not (out / "manifest.json").exists()
