"""Training data: sampling, exact log-probs, replay through the masker, labels, storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.exact_distribution import sequence_logprobs
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.shim.training_data import TENSORS_FILE, TrainingData, sample_training_data

torch.set_num_threads(1)
BV4_BACKEND = "syncode"


@pytest.fixture(scope="module")
def masker(lm):
    return get_backend(BV4_BACKEND).compile(builtin_grammar("bv4"), lm.tokenizer, lm.vocab_size)


@pytest.fixture(scope="module")
def data(lm, masker):
    return sample_training_data(lm, masker, masker.grammar.default_prompt, 80, max_new_tokens=96,
                                seed=3, progress=False)


def test_labels_come_from_the_reference_acceptor(data, masker):
    acceptor = reference_acceptor(masker.grammar)
    ref = np.array([acceptor.accepts(t) for t in data.texts])
    assert (data.reference_accepts == ref).all()
    assert (data.valid == (ref & data.masker_complete & ~data.truncated)).all()
    assert 0 < data.valid.mean() < 1, "bv4 with the shipped LM has both valid and invalid samples"
    assert (data.row_label == data.valid[data.row_completion]).all()
    assert data.manifest["masker_accepted_invalid"] == 0
    assert data.manifest["masker_rejected_valid"] == 0


def test_rows_stop_at_the_first_rejected_token(data, masker):
    for i in range(data.n_completions):
        rows = np.flatnonzero(data.row_completion == i)
        tokens = data.completion_tokens(i)
        assert (data.row_step[rows] == np.arange(len(rows))).all()
        assert (data.row_token[rows] == tokens[: len(rows)]).all()
        if data.cut_step[i] >= 0:
            assert len(rows) == data.cut_step[i]
            state = masker.new_state()
            for t in tokens[: len(rows)]:
                state.advance(int(t))
            assert not state.allowed_mask()[tokens[len(rows)]]
            assert not data.valid[i]
        elif not data.truncated[i]:
            assert len(rows) == len(tokens)  # EOS row included


def test_row_features_and_allowed_sets_replay_the_masker(data, masker):
    i = int(np.flatnonzero(data.valid)[0])
    rows = np.flatnonzero(data.row_completion == i)
    state = masker.new_state()
    for r in rows:
        assert data.states[data.row_state[r]].parser_state == state.features().parser_state
        assert data.states[data.row_state[r]].partial_lexeme == state.features().partial_lexeme
        ids, lps = data.allowed(r)
        assert set(ids.tolist()) <= set(state.allowed_token_ids().tolist())
        assert data.row_token[r] in ids
        assert np.logaddexp.reduce(lps.astype(np.float64)) <= data.row_log_z[r] + 1e-4
        assert data.row_lm_logprob[r] <= data.row_log_z[r] + 1e-5
        state.advance(int(data.row_token[r]))
    assert state.is_finished


def test_token_logprobs_are_the_lm_s_exact_ones(data, lm):
    """The recorded per-token log-probs sum to the teacher-forced sequence log-prob."""
    idx = range(0, data.n_completions, 8)
    seqs = [data.completion_tokens(i).tolist() for i in idx]
    recorded = [float(data.completion_token_logprobs[data.completion_offsets[i]:
                                                     data.completion_offsets[i + 1]].sum())
                for i in idx]
    forced = sequence_logprobs(lm, builtin_grammar("bv4").default_prompt, seqs)
    np.testing.assert_allclose(recorded, forced, rtol=1e-4, atol=1e-3)


def test_save_load_round_trip_and_tamper_check(data, tmp_path):
    data.save(tmp_path / "d")
    again = TrainingData.load(tmp_path / "d")
    assert again.states == data.states and again.texts == data.texts
    for name in TrainingData._TENSORS:
        np.testing.assert_array_equal(getattr(again, name), getattr(data, name))
    blob = (tmp_path / "d" / TENSORS_FILE).read_bytes()
    (tmp_path / "d" / TENSORS_FILE).write_bytes(blob[:-10])
    with pytest.raises(ValueError, match="sha256"):
        TrainingData.load(tmp_path / "d")


def test_subset_keeps_whole_completions(data):
    sub = data.subset(np.array([1, 4, 5]))
    assert sub.n_completions == 3 and sub.texts == [data.texts[i] for i in (1, 4, 5)]
    assert sub.n_rows == int(np.isin(data.row_completion, [1, 4, 5]).sum())
    r = int(np.flatnonzero(data.row_completion == 4)[0])
    r2 = int(np.flatnonzero(sub.row_completion == 1)[0])
    np.testing.assert_array_equal(sub.allowed(r2)[0], data.allowed(r)[0])


def test_same_seed_same_samples(lm, masker):
    a = sample_training_data(lm, masker, masker.grammar.default_prompt, 6, seed=11,
                             max_new_tokens=64, progress=False)
    b = sample_training_data(lm, masker, masker.grammar.default_prompt, 6, seed=11,
                             max_new_tokens=64, progress=False)
    assert a.texts == b.texts


def test_truncated_completions_are_invalid(lm, masker):
    d = sample_training_data(lm, masker, masker.grammar.default_prompt, 8, seed=0,
                             max_new_tokens=4, progress=False)
    assert d.truncated.all() and not d.valid.any() and (d.row_label == 0).all()
