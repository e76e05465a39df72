"""fit_controller across regimes: the target is chosen by measurement, never 'no training rows'."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.prompting import detect_line_answers, render_prompt
from shim_adapters.lm.sampling import prefill
from shim_adapters.shim.correction import sample_with_shim
from shim_adapters.shim.fitting import fit_controller
from shim_adapters.shim.prompt_set import PromptOutsideFitWarning

torch.set_num_threads(1)
FAST = dict(n_splits=3, reg_grid=(1.0,))
#: The shipped LM answers this prompt with binary digits: bv4 is then (almost) never valid.
RARE_PROMPT = builtin_grammar("binary5").default_prompt


@pytest.fixture(scope="module")
def bv4(shipped_lm):
    return get_backend("xgrammar").compile(builtin_grammar("bv4"), shipped_lm.tokenizer,
                                           shipped_lm.vocab_size)


@pytest.fixture(scope="module")
def binary5(shipped_lm):
    return get_backend("xgrammar").compile(builtin_grammar("binary5"), shipped_lm.tokenizer,
                                           shipped_lm.vocab_size)


def test_auto_target_uses_rollout_labels_and_records_p_valid(shipped_lm, binary5):
    c, manifest = fit_controller(shipped_lm, binary5, n_samples=120, progress=False, **FAST)
    t = manifest["training"]
    assert t["target"] == "rollout" and "auto" in t["target_reason"]
    # P(L) estimated from the masked rollouts (mean ∏ Z) agrees with the LM's valid rate
    assert 0.35 < t["p_valid_estimate"] < 0.7
    assert t["forward_tokens_per_valid_sample"] > 0
    final, m2 = fit_controller(shipped_lm, binary5, n_samples=120, target="final",
                               progress=False, **FAST)
    assert m2["training"]["target"] == "final"
    assert abs(m2["training"]["p_valid_estimate"] - t["p_valid_estimate"]) < 0.2


def test_rarely_valid_lm_gets_rollout_labels_and_never_no_training_rows(shipped_lm, bv4):
    c, manifest = fit_controller(shipped_lm, bv4, RARE_PROMPT, n_samples=60, progress=False,
                                 **FAST)
    t = manifest["training"]
    assert t["target"] == "rollout" and t["p_valid_estimate"] < 0.3
    assert t["data_n_rows"] > 0 and t["data_valid_fraction"] == 1.0  # masked rollouts
    assert c.falls_back_to_masking_ == (c.beta_ == 0.0)
    # the paper's recipe has nothing to learn from here, and says what to do instead
    with pytest.raises(ValueError, match="no training rows.*target='rollout'"):
        fit_controller(shipped_lm, bv4, RARE_PROMPT, n_samples=30, target="final",
                       progress=False, **FAST)


def test_rounds_split_one_budget_and_record_each_decision(shipped_lm, binary5):
    c, manifest = fit_controller(shipped_lm, binary5, n_samples=200, target="rollout",
                                 rounds=2, progress=False, **FAST)
    rounds = manifest["training"]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert sum(r["n_samples"] for r in rounds) == 200
    assert rounds[0]["proposal"] == "masked"
    # a fit that fell back for want of evidence (not of gain) proposes at its untrusted β
    thin = rounds[0]["fallback_reason"] == "low_target_samples"
    assert rounds[1]["proposal"] == ("masked" if rounds[0]["falls_back_to_masking"] and not thin
                                     else "shim")
    assert isinstance(rounds[1]["kept"], bool) and np.isfinite(rounds[1]["gain_over_previous"])
    with pytest.raises(ValueError, match="rounds > 1"):
        fit_controller(shipped_lm, binary5, n_samples=20, target="final", rounds=2)


def test_chat_template_is_applied_and_its_absence_is_a_clear_error(shipped_lm):
    tok = shipped_lm.tokenizer
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(tok, "hi", chat=True)
    plain = render_prompt(tok, "hi")
    assert plain.text == "hi" and plain.add_special_tokens
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    try:
        chat = render_prompt(tok, "hi", chat=True)
    finally:
        tok.chat_template = None
    assert chat.text == "<user>hi\n<assistant>" and not chat.add_special_tokens


def test_line_answer_probe_measures_where_answers_end(shipped_lm, binary5):
    probe = detect_line_answers(prefill(shipped_lm, RARE_PROMPT), binary5)
    assert probe.accepting_steps > 0 and not probe.newline_allowed
    # the shipped LM ends its binary strings with EOS: nothing to fold
    assert probe.eos_mass > probe.newline_mass and not probe.fold
    assert "answers end at EOS" in probe.reason


def test_sampling_uses_the_lm_view_the_controller_was_fitted_on(shipped_lm, binary5):
    c, _ = fit_controller(shipped_lm, binary5, n_samples=80, progress=False,
                          stop_at_newline=True, **FAST)
    assert {k: c.prompting_[k] for k in ("chat", "stop_at_newline")} == \
        {"chat": False, "stop_at_newline": True}
    assert len(c.prompting_["prompt_ids_sha256"]) == 1  # the fitted prompt, as token ids
    with warnings.catch_warnings():  # RARE_PROMPT is the default prompt it was fitted on
        warnings.simplefilter("error", PromptOutsideFitWarning)
        out = sample_with_shim(shipped_lm, binary5, c, RARE_PROMPT, 4, max_new_tokens=12,
                               seed=0)
    assert all(out.complete)
    with pytest.raises(ValueError, match="num_samples"):
        sample_with_shim(shipped_lm, binary5, c, RARE_PROMPT, 0)
