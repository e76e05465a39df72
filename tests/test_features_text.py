"""Text features: hashed byte n-grams of the token's text (and of the partial lexeme), crossed
with the state; the vectorised scoring paths equal the design matrix; artefacts with text
features say so by their format version and load back identically; encoders and artefacts
without them read as before."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.mask.protocol import StateFeatures
from shim_adapters.shim.artefact import (
    FORMAT_VERSION,
    TEXT_FEATURES_FORMAT_VERSION,
    load_controller,
    read_manifest,
    save_controller,
)
from shim_adapters.shim.controller import log_sigmoid
from shim_adapters.shim.features import FeatureEncoder, text_ngrams
from shim_adapters.shim.fitting import FitRecipe, fit_with_recipe

torch.set_num_threads(1)
TEXTS = {4: " name", 5: " names", 9: "42", 11: "(", 12: " nam"}
STATES = [StateFeatures(("S1",), frozenset({("NAME", 0)}), "na", None),
          StateFeatures(("S2",), frozenset({("NUMBER", 1)}), "4", None)]


def test_ngrams_are_framed_and_distinct():
    assert text_ngrams("ab", 2) == [b"\x02", b"a", b"b", b"\x03", b"\x02a", b"ab", b"b\x03"]
    assert text_ngrams("aa", 1) == [b"\x02", b"a", b"\x03"]


def test_tokens_sharing_text_share_columns_and_crosses_see_the_state():
    enc = FeatureEncoder(min_cross_count=1, text_ngrams=3).fit(
        STATES, np.array([0, 0, 1, 1]), np.array([4, 5, 9, 4]), token_texts=TEXTS)
    assert enc.n_text_ > 0 and enc.n_text_cross_ > 0
    X = enc.transform(STATES, np.array([0, 0, 1]), np.array([4, 5, 9])).tocsr()
    text = slice(enc.n_state_ + enc.n_token_ + enc.n_cross_,
                 enc.n_state_ + enc.n_token_ + enc.n_cross_ + enc.n_text_)
    name, names, digits = (set(X[i, text].indices) for i in range(3))
    assert len(name & names) >= 5 and not (name & names) - name  # " name" ⊂ " names"
    assert len(name & digits) == 2  # only the start and end marks
    # the partial lexeme's n-grams are state features
    assert any(s.startswith("plg:") for s in enc.state_strings(STATES[0]))
    # " names" was seen in state 0 only; in state 1 only the n-grams it shares with " name"
    # (seen there) cross: text crosses generalise across tokens, per state
    tc = slice(text.stop, enc.n_features_)
    in_seen = enc.transform(STATES, np.array([0]), np.array([5])).tocsr()[0, tc].nnz
    in_other = enc.transform(STATES, np.array([1]), np.array([5])).tocsr()[0, tc].nnz
    assert 0 < in_other < in_seen


def test_text_manifest_round_trip_and_plain_manifests_unchanged():
    enc = FeatureEncoder(min_cross_count=1, text_ngrams=2).fit(
        STATES, np.array([0, 1, 1]), np.array([4, 9, 12]), token_texts=TEXTS)
    again = FeatureEncoder.from_manifest(enc.vocab_manifest(), enc.tensors())
    rows, toks = np.array([0, 1, 1, 0]), np.array([4, 9, 12, 11])
    assert (enc.transform(STATES, rows, toks) != again.transform(STATES, rows, toks)).nnz == 0
    plain = FeatureEncoder().fit(STATES, np.array([0]), np.array([4]))
    assert "text_ngrams" not in plain.vocab_manifest()["params"]
    assert "text" not in plain.vocab_manifest() and set(plain.tensors()) == {
        "encoder.cross_vocab"}
    with pytest.raises(ValueError, match="text of every known token"):
        FeatureEncoder(text_ngrams=2).fit(STATES, np.array([0]), np.array([4]), token_texts={})


@pytest.fixture(scope="module")
def text_fit(shipped_lm, tmp_path_factory):
    masker = get_backend("xgrammar").compile(builtin_grammar("json"), shipped_lm.tokenizer,
                                             shipped_lm.vocab_size)
    out = tmp_path_factory.mktemp("text")
    recipe = FitRecipe(n_samples=40, max_samples=None, max_new_tokens=24, progress=False,
                       stop_at_newline=False, text_features="auto",
                       controller_params={"reg_grid": (1.0,), "min_target_samples": 1.0})
    c, manifest = fit_with_recipe(shipped_lm, masker, recipe, output_dir=out)
    forced = fit_with_recipe(shipped_lm, masker, replace(recipe, text_features="on"))[0]
    plain_dir = tmp_path_factory.mktemp("plain")
    fit_with_recipe(shipped_lm, masker, replace(recipe, text_features="off"),
                    output_dir=plain_dir)
    return masker, c, manifest, plain_dir, forced


def test_auto_keeps_the_better_held_out_score(text_fit):
    _, c, manifest, _, _ = text_fit
    features = manifest["training"]["features"]
    scores = {f["text_ngrams"]: f["heldout_score"] for f in features["candidates"]}
    assert set(scores) == {0, 3}
    assert features["text_ngrams"] == max(scores, key=scores.get) == c.text_ngrams


def test_scoring_paths_equal_the_design_matrix_with_text_features(text_fit, shipped_lm):
    masker, _, _, out, c = text_fit
    assert c.encoder_.n_text_ > 0 and c.encoder_.n_text_cross_ > 0
    state = masker.new_state()
    for token in shipped_lm.tokenizer.encode('{"a', add_special_tokens=False)[:1]:
        state.advance(token)
    allowed = np.flatnonzero(state.allowed_mask()).astype(np.int64)
    features = state.features()
    got = c.predict_log_gamma(features, allowed)
    X = c.encoder_.transform([features], np.zeros(len(allowed), dtype=np.int64), allowed)
    expect = c.beta_ * log_sigmoid(c._logits(c.weights_, X))
    expect[np.isin(allowed, c.eos_token_ids_)] = 0.0
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
    shared, values = c.state_log_gamma(features)
    pos = np.searchsorted(c.scored_token_ids_, allowed)
    known = (pos < len(values)) & (c.scored_token_ids_[np.minimum(pos, len(values) - 1)] ==
                                   allowed)
    np.testing.assert_allclose(values[pos[known]], got[known], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[~known], shared, rtol=1e-5, atol=1e-6)


def test_text_artefacts_carry_version_2_and_load_back_identically(text_fit, shipped_lm,
                                                                   tmp_path):
    masker, _, _, _, c = text_fit
    save_controller(tmp_path, c, masker, shipped_lm)
    assert read_manifest(tmp_path)["format_version"] == TEXT_FEATURES_FORMAT_VERSION
    loaded, manifest = load_controller(tmp_path, masker, shipped_lm)
    assert manifest["controller"]["params"]["text_ngrams"] == 3
    state = masker.new_state()
    allowed = np.flatnonzero(state.allowed_mask()).astype(np.int64)
    np.testing.assert_allclose(loaded.predict_log_gamma(state.features(), allowed),
                               c.predict_log_gamma(state.features(), allowed), rtol=1e-6)


def test_artefacts_without_text_features_stay_version_1(text_fit):
    plain_dir = text_fit[3]
    manifest = read_manifest(plain_dir)
    assert manifest["format_version"] == FORMAT_VERSION
    assert "text_ngrams" not in manifest["controller"]["params"]
    assert manifest["training"]["features"]["text_ngrams"] == 0
