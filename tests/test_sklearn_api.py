"""Controllers follow scikit-learn's estimator conventions: clone, get/set_params, predict,
score."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.shim.controller import CONTROLLERS, make_controller
from shim_adapters.shim.training_data import sample_training_data


@pytest.fixture(scope="module")
def data(lm):
    masker = get_backend("syncode").compile(builtin_grammar("binary5"), lm.tokenizer,
                                            lm.vocab_size)
    return sample_training_data(lm, masker, masker.grammar.default_prompt, 80, max_new_tokens=12,
                                seed=0, progress=False)


@pytest.mark.parametrize("kind", list(CONTROLLERS))
def test_clone_copies_parameters_and_not_the_fit(kind, data):
    params = {"n_splits": 2, "reg_grid": [0.5]} | ({"epochs": 2} if kind == "MLP" else {})
    controller = make_controller(kind, **params).fit(data)
    copy = clone(controller)
    assert type(copy) is type(controller) and copy.get_params() == controller.get_params()
    assert copy.get_params(deep=True)["reg_grid"] == (0.5,)
    assert not hasattr(copy, "weights_")
    assert copy.set_params(n_splits=3) is copy and copy.n_splits == 3
    assert controller.n_splits == 2
    with pytest.raises(ValueError, match="no parameter"):
        copy.set_params(nonsense=1)


@pytest.mark.parametrize("kind", ["LR_FULL", "MLP"])
def test_predict_and_score_follow_predict_proba(kind, data):
    controller = make_controller(kind, n_splits=2, **({"epochs": 3} if kind == "MLP" else {}))
    controller.fit(data)
    proba = controller.predict_proba(data)[:, 1]
    labels = controller.predict(data)
    np.testing.assert_array_equal(labels, (proba >= 0.5).astype(int))
    expected = float(np.mean(labels == (np.asarray(data.row_label) >= 0.5)))
    assert controller.score(data) == pytest.approx(expected)
    assert controller.score(data, 1 - np.asarray(data.row_label)) == pytest.approx(
        1 - expected)
    with pytest.raises(ValueError, match="needs y"):
        controller.score([(data.states[0], 0)])
