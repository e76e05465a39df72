"""explain(): why a token is allowed or refused, and the γ̂ the controller gives it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.mask.explain import explain
from shim_adapters.shim.controller import make_controller
from shim_adapters.shim.training_data import sample_training_data

GRAMMAR = Grammar(text='start: "a" "b"+\n', format="lark", name="ab")


@pytest.fixture(scope="module")
def masker(lm):
    return get_backend("syncode").compile(GRAMMAR, lm.tokenizer, lm.vocab_size)


def after(masker, lm, text):
    state = masker.new_state()
    for t in lm.tokenizer.encode(text, add_special_tokens=False):
        state.advance(t)
    return state


def token(lm, text):
    (tid,) = lm.tokenizer.encode(text, add_special_tokens=False)
    return tid


def test_allowed_refused_and_eos_are_explained(masker, lm):
    state = after(masker, lm, "a")
    ok = explain(state, token(lm, "b"))
    assert ok.allowed and not ok.is_eos and ok.next_state["text"] == "ab"
    assert ok.next_state["eos_allowed"] and state.text() == "a"  # the state is not moved
    bad = explain(state, token(lm, "a"))
    assert not bad.allowed and "expected: A" in bad.reason and bad.next_state is None
    eos = explain(state, next(iter(masker.eos_token_ids)))
    assert not eos.allowed and "does not accept" in eos.reason
    assert "refused" in bad.lines()[0] and bad.lines()[0].startswith(f"token {bad.token_id} 'a'")
    assert "not a token id" in explain(state, masker.vocab_size + 5).reason


def test_gamma_is_the_controller_value_and_its_features_add_up(masker, lm):
    masker = get_backend("syncode").compile(builtin_grammar("binary5"), lm.tokenizer,
                                            lm.vocab_size)
    data = sample_training_data(lm, masker, masker.grammar.default_prompt, 100,
                                max_new_tokens=12, seed=0, progress=False)
    controller = make_controller("LR_FULL", n_splits=2).fit(data)
    state = after(masker, lm, "1")
    tid = int(state.allowed_token_ids()[0])
    e = explain(state, tid, controller, top=10_000)
    expected = controller.predict_log_gamma(state.features(), np.array([tid]), damped=False)[0]
    assert e.log_gamma == pytest.approx(expected)
    assert e.log_gamma_damped == pytest.approx(controller.beta_ * expected)
    logit = float(controller.weights_["embed_bias"][0]) + sum(c.weight for c in e.contributions)
    assert -math.log1p(math.exp(-logit)) == pytest.approx(e.log_gamma)
    assert any(c.name.startswith("token ") for c in e.contributions)
    assert any("gamma-hat" in line for line in e.lines())
