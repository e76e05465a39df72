"""FeatureEncoder: vocabularies, missing features, crosses, vectorised == row-by-row columns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim_adapters.mask.protocol import StateFeatures
from shim_adapters.shim.features import FeatureEncoder, feature_hash, pair_hash

PARSER = st.lists(st.sampled_from(["S0", "S1", "S7", "S12"]), min_size=1, max_size=5).map(tuple)
LEXER = st.frozensets(st.tuples(st.sampled_from(["VAR", "CONST", "OP"]), st.integers(0, 4)),
                      max_size=3)
STATES = st.builds(StateFeatures,
                   parser_state=st.none() | PARSER,
                   lexer_state=st.none() | LEXER,
                   partial_lexeme=st.none() | st.sampled_from(["", "(", "(bv", "#x"]))


def _rows(states, n_rows, rng):
    row_state = rng.integers(0, len(states), n_rows)
    row_token = rng.integers(0, 12, n_rows)
    return row_state, row_token


@settings(max_examples=40, deadline=None)
@given(states=st.lists(STATES, min_size=1, max_size=6), seed=st.integers(0, 1000),
       groups=st.sampled_from([("token",), ("state", "token"), ("state", "token", "cross")]))
def test_vectorised_columns_equal_the_design_matrix(states, seed, groups):
    """encode_state + token_columns + cross_columns give exactly transform()'s columns."""
    rng = np.random.default_rng(seed)
    row_state, row_token = _rows(states, 60, rng)
    enc = FeatureEncoder(groups=groups, min_cross_count=1).fit(states, row_state, row_token)
    candidates = np.arange(15)  # includes tokens never seen in training (12..14)
    for sid, f in enumerate(states):
        X = enc.transform([f], np.zeros(len(candidates), dtype=int), candidates).toarray()
        e = enc.encode_state(f)
        tok = enc.token_columns(candidates)
        cross = enc.cross_columns(e.cross_keys, candidates)
        for j, t in enumerate(candidates):
            expected = set(e.state_columns.tolist())
            if tok[j] >= 0:
                expected.add(enc.n_state_ + int(tok[j]))
            expected |= {enc.n_state_ + enc.n_token_ + int(c) for c in cross[:, j] if c >= 0}
            assert set(np.flatnonzero(X[j]).tolist()) == expected, (f, t)


def test_missing_features_are_absent_and_never_fire():
    full = StateFeatures(("S1", "S0"), frozenset({("VAR", 1)}), "(bv")
    bare = StateFeatures()  # a backend with every feature missing
    enc = FeatureEncoder().fit([full, bare], np.array([0, 1, 1]), np.array([3, 3, 4]))
    assert enc.encode_state(bare).state_columns.size == 0
    assert enc.encode_state(bare).cross_keys.size == 0
    strings = enc.state_strings(full)
    assert "ps0:S1" in strings and "ps1:S0" in strings and "pl:(bv" in strings
    assert "lx:VAR:1" in strings and "lxt:VAR" in strings and "plen:3-4" in strings
    X = enc.transform([bare], np.array([0, 0]), np.array([3, 99])).toarray()
    # token 3 fires its own column only; unseen token 99 fires nothing
    assert X[0].sum() == 1 and X[1].sum() == 0


def test_parser_top_k_limits_the_recent_states():
    f = StateFeatures(parser_state=("A", "B", "C", "D"))
    enc = FeatureEncoder(parser_top_k=2)
    assert [s for s in enc.state_strings(f) if s.startswith("ps") and ":" in s[:4]] == \
        ["ps0:A", "ps1:B"]


def test_crosses_distinguish_tokens_per_state():
    """The same token in two states gets two different cross columns."""
    a, b = StateFeatures(("SA",)), StateFeatures(("SB",))
    enc = FeatureEncoder(groups=("token", "cross"), cross_with=("parser_state",),
                         min_cross_count=1)
    enc.fit([a, b], np.array([0, 1]), np.array([5, 5]))
    assert enc.n_cross_ == 2
    ca = enc.cross_columns(enc.encode_state(a).cross_keys, np.array([5, 6]))
    cb = enc.cross_columns(enc.encode_state(b).cross_keys, np.array([5, 6]))
    assert ca[0, 0] >= 0 and cb[0, 0] >= 0 and ca[0, 0] != cb[0, 0]
    assert ca[0, 1] == -1 and cb[0, 1] == -1  # (state, 6) never seen


def test_min_cross_count_drops_rare_pairs():
    a = StateFeatures(("SA",))
    enc = FeatureEncoder(groups=("token", "cross"), cross_with=("parser_state",),
                         min_cross_count=2)
    enc.fit([a], np.array([0, 0, 0]), np.array([1, 1, 2]))
    assert enc.n_cross_ == 1


def test_crosses_without_token_columns_are_refused():
    with pytest.raises(ValueError, match="token group"):
        FeatureEncoder(groups=("state", "cross")).fit([StateFeatures(("S",))], np.array([0]),
                                                      np.array([1]))


def test_pair_hash_is_stable_and_mixes_both_arguments():
    keys = np.array([1, 2], dtype=np.uint64)
    h = pair_hash(keys[:, None], np.array([7, 8]))
    assert h.shape == (2, 2) and len(np.unique(h)) == 4
    # fixed values: both hashes are part of the artefact format (PAIR_HASH)
    assert int(pair_hash(np.array([1], dtype=np.uint64), np.array([7]))[0]) == \
        17388166129998380965
    assert feature_hash("ps0:S1") == 15494152354667462352


def test_manifest_round_trip_gives_identical_columns():
    states = [StateFeatures(("S1",), frozenset({("VAR", 2)}), "s", {"depth": 3}),
              StateFeatures(("S2", "S1"), None, "(", {"depth": (1, 2)})]
    enc = FeatureEncoder(min_cross_count=1).fit(states, np.array([0, 1, 1]), np.array([4, 4, 9]))
    again = FeatureEncoder.from_manifest(enc.vocab_manifest(), enc.tensors())
    rows, toks = np.array([0, 1, 1, 0]), np.array([4, 9, 4, 11])
    assert (enc.transform(states, rows, toks) != again.transform(states, rows, toks)).nnz == 0


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="groups"):
        FeatureEncoder(groups=("colour",)).fit([StateFeatures()], np.array([0]), np.array([1]))
