"""Controller artefacts: round trip, size, and refusal of anything that does not match."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.errors import ManifestMismatchError
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.shim.artefact import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    ArtefactCorruptedError,
    load_controller,
    save_controller,
)
from shim_adapters.shim.controller import CONTROLLERS, make_controller
from shim_adapters.shim.training_data import sample_training_data

torch.set_num_threads(1)
BACKEND = "syncode"
OTHER_BACKEND = "xgrammar"


@pytest.fixture(scope="module")
def masker(lm):
    return get_backend(BACKEND).compile(builtin_grammar("bv4"), lm.tokenizer, lm.vocab_size)


@pytest.fixture(scope="module")
def fitted(lm, masker):
    data = sample_training_data(lm, masker, masker.grammar.default_prompt, 150,
                                max_new_tokens=96, seed=2, progress=False)
    return data, {k: make_controller(k, n_splits=2, **({"epochs": 5} if k == "MLP" else {}))
                  .fit(data) for k in CONTROLLERS}


@pytest.fixture()
def saved(tmp_path, fitted, masker, lm):
    _, ctrl = fitted
    save_controller(tmp_path / "a", ctrl["LR_FULL"], masker, lm, prompt="p")
    return tmp_path / "a"


@pytest.mark.parametrize("kind", list(CONTROLLERS))
def test_round_trip_gives_identical_predictions(tmp_path, fitted, masker, lm, kind):
    data, ctrl = fitted
    manifest = save_controller(tmp_path / kind, ctrl[kind], masker, lm, prompt="p")
    loaded, m2 = load_controller(tmp_path / kind, masker, lm)
    assert m2 == manifest and type(loaded) is type(ctrl[kind])
    assert loaded.beta_ == ctrl[kind].beta_
    state = masker.new_state()
    for t in data.completion_tokens(int(np.flatnonzero(data.valid)[0]))[:-1]:
        allowed = state.allowed_token_ids()
        np.testing.assert_array_equal(loaded.predict_log_gamma(state.features(), allowed),
                                      ctrl[kind].predict_log_gamma(state.features(), allowed))
        state.advance(int(t))
    assert (tmp_path / kind / WEIGHTS_FILE).stat().st_size < 1 << 20


def test_manifest_records_what_the_controller_depends_on(saved, masker, lm, fitted):
    m = json.loads((saved / MANIFEST_FILE).read_text())
    assert m["grammar_sha256"] == masker.grammar.sha256
    assert m["tokenizer_sha256"] == masker.tokenizer_identity.sha256
    assert (m["backend"], m["backend_version"]) == (BACKEND, masker.backend_version)
    assert (m["lm_identifier"], m["lm_revision"]) == (lm.identifier, lm.revision)
    assert m["features"]["feature_status"] == {k: v.value for k, v in
                                               masker.feature_status.items()}
    assert m["controller"]["kind"] == "LR_FULL" and "reg_grid" in m["controller"]["params"]
    for key in ("n_rows", "n_completions", "valid_fraction", "cv_log_loss", "beta",
                "fit_seconds"):
        assert key in m["training"]
    assert m["training"]["n_completions"] == fitted[0].n_completions


def test_tampered_manifest_is_refused(saved, masker, lm):
    m = json.loads((saved / MANIFEST_FILE).read_text())
    m["controller"]["beta"] = 0.123
    (saved / MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(ArtefactCorruptedError, match="manifest_sha256"):
        load_controller(saved, masker, lm)


def test_unparseable_manifest_is_refused(saved, masker):
    (saved / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ArtefactCorruptedError, match="not valid JSON"):
        load_controller(saved, masker)


def test_truncated_weights_are_refused(saved, masker):
    blob = (saved / WEIGHTS_FILE).read_bytes()
    (saved / WEIGHTS_FILE).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ArtefactCorruptedError, match="truncated"):
        load_controller(saved, masker)


def test_modified_weights_are_refused(saved, masker):
    blob = bytearray((saved / WEIGHTS_FILE).read_bytes())
    blob[-1] ^= 0xFF
    (saved / WEIGHTS_FILE).write_bytes(bytes(blob))
    with pytest.raises(ArtefactCorruptedError, match="sha256"):
        load_controller(saved, masker)


def test_missing_weights_are_refused(saved, masker):
    (saved / WEIGHTS_FILE).unlink()
    with pytest.raises(ArtefactCorruptedError, match="missing"):
        load_controller(saved, masker)


def test_other_grammar_is_refused(saved, lm):
    other = get_backend(BACKEND).compile(builtin_grammar("binary5"), lm.tokenizer, lm.vocab_size)
    with pytest.raises(ManifestMismatchError) as err:
        load_controller(saved, other, lm)
    assert err.value.field == "grammar_sha256"


def test_other_backend_is_refused(saved, lm):
    other = get_backend(OTHER_BACKEND).compile(builtin_grammar("bv4"), lm.tokenizer,
                                               lm.vocab_size)
    with pytest.raises(ManifestMismatchError) as err:
        load_controller(saved, other, lm)
    assert err.value.field == "backend"


def test_other_tokenizer_is_refused(saved, lm):
    from transformers import AutoTokenizer

    from shim_adapters.lm.loading import default_lm_path

    tok = AutoTokenizer.from_pretrained(default_lm_path(), local_files_only=True)
    tok.add_tokens(["<extra-token>"])  # same class, same model, different tokenizer
    other = get_backend(BACKEND).compile(builtin_grammar("bv4"), tok, lm.vocab_size)
    with pytest.raises(ManifestMismatchError) as err:
        load_controller(saved, other, lm)
    assert err.value.field == "tokenizer_sha256"


def test_other_lm_revision_is_refused(saved, masker, lm):
    with pytest.raises(ManifestMismatchError) as err:
        load_controller(saved, masker, dataclasses.replace(lm, revision="0" * 64))
    assert err.value.field == "lm_revision"
    # without an LM only grammar/tokenizer/backend are checked
    loaded, _ = load_controller(saved, masker)
    assert loaded.kind == "LR_FULL"


def test_refit_replaces_the_artefact_and_leaves_one_weights_file(saved, fitted, masker, lm):
    _, ctrl = fitted
    first = json.loads((saved / MANIFEST_FILE).read_text())
    second = save_controller(saved, ctrl["MLP"], masker, lm, prompt="p")
    assert second["weights_file"] != first["weights_file"]
    assert sorted(p.name for p in saved.iterdir()) == sorted([MANIFEST_FILE,
                                                              second["weights_file"]])
    assert load_controller(saved, masker, lm)[0].kind == "MLP"
    third = save_controller(saved, ctrl["LR_NT"], masker, lm, prompt="p")
    assert third["weights_file"] == WEIGHTS_FILE
    assert load_controller(saved, masker, lm)[0].kind == "LR_NT"


@pytest.mark.parametrize("where", ["weights", "manifest"])
def test_interrupted_refit_leaves_the_previous_artefact_loadable(saved, fitted, masker, lm,
                                                                 monkeypatch, where):
    import os

    from shim_adapters.shim import artefact

    _, ctrl = fitted
    real_replace = os.replace

    def interrupted(src, dst):
        if (where == "manifest") == (Path(dst).name == MANIFEST_FILE):
            raise KeyboardInterrupt  # the user hits Ctrl-C mid-write
        real_replace(src, dst)

    monkeypatch.setattr(artefact.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_controller(saved, ctrl["MLP"], masker, lm, prompt="p")
    monkeypatch.undo()
    loaded, _ = load_controller(saved, masker, lm)
    assert loaded.kind == "LR_FULL"
    assert not [p for p in saved.iterdir() if p.name.endswith(".tmp")]


def test_weights_file_outside_the_artefact_is_refused(saved, masker):
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    manifest["weights_file"] = "../elsewhere.safetensors"
    from shim_adapters.shim.artefact import _manifest_digest

    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (saved / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ArtefactCorruptedError, match="weights_file"):
        load_controller(saved, masker)


def test_calling_the_tokenizer_with_padding_keeps_its_identity(saved, lm):
    """transformers switches the backend's padding/truncation on when the tokenizer is called
    with padding=True / truncation=True; controllers fitted before must still load."""
    from transformers import AutoTokenizer

    from shim_adapters.lm.loading import default_lm_path

    tok = AutoTokenizer.from_pretrained(default_lm_path(), local_files_only=True)
    before = tok.backend_tokenizer.to_str()
    tok(["a", "bb b"], padding=True, truncation=True, max_length=3)
    assert tok.backend_tokenizer.to_str() != before  # the call did change the serialisation
    masker = get_backend(BACKEND).compile(builtin_grammar("bv4"), tok, lm.vocab_size)
    loaded, _ = load_controller(saved, masker, lm)
    assert loaded.kind == "LR_FULL"
