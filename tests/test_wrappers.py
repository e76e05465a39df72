"""Wrappers around what users already run: plain generate, XGrammar, SynCode, outlines.

Real components throughout: the shipped LM, the real backend processors, small controllers
fitted here (forced β = 1 so that the correction is never a no-op).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.errors import ManifestMismatchError
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.integrations.hf import (
    BackendDisagreementError,
    UnsupportedDecodingError,
    shim_logits_processor,
)
from shim_adapters.lm.generation import FAITHFUL_SAMPLING
from shim_adapters.shim.artefact import save_controller
from shim_adapters.shim.correction import ShimLogitsProcessor
from shim_adapters.shim.fitting import fit_controller

torch.set_num_threads(1)
EOS = 0
FIT = dict(kind="LR_FULL", n_samples=60, max_new_tokens=48, progress=False, n_splits=2,
           beta_grid=(1.0,), reg_grid=(1.0,))


@pytest.fixture(scope="module")
def lm():
    from shim_adapters.lm.loading import load_lm

    lm = load_lm(None)
    assert lm.tokenizer.eos_token_id == EOS
    return lm


_FITTED: dict = {}


def fitted(lm, backend: str, grammar: str):
    """(masker, (controller, manifest)) for backend x grammar, fitted once per session."""
    key = (backend, grammar)
    if key not in _FITTED:
        masker = get_backend(backend).compile(builtin_grammar(grammar), lm.tokenizer,
                                              lm.vocab_size)
        _FITTED[key] = (masker, fit_controller(lm, masker, seed=3, **FIT))
    return _FITTED[key]


# ---- the three backend processors, as users build them ---------------------------------------
def xgrammar_processor(lm, grammar: str):
    import xgrammar as xgr

    masker, _ = fitted(lm, "xgrammar", grammar)
    info = xgr.TokenizerInfo.from_huggingface(lm.tokenizer, vocab_size=lm.vocab_size,
                                              stop_token_ids=[EOS])
    # the user compiles the grammar text the controller was fitted on (EBNF for XGrammar)
    compiled = xgr.GrammarCompiler(info).compile_grammar(str(masker.compiled.grammar))
    return xgr.contrib.hf.LogitsProcessor(compiled)


@pytest.fixture(scope="module")
def syncode_cls(tmp_path_factory):
    """SynCode's processor, imported at its first use: the other backends' cases share this
    fixture and run where SynCode is not installed (transformers 5)."""
    cache = str(tmp_path_factory.mktemp("syncode_cache")) + "/"  # SynCode pickles there

    def make(lm, grammar: str, **kwargs):
        from shim_syncode._syncode_import import syncode_modules

        syncode_modules()  # import SynCode without letting it rewire logging
        import syncode.common as common

        common.SYNCODE_CACHE = cache
        from syncode.grammar_mask.logits_processor import SyncodeLogitsProcessor
        from syncode.parsers.grammars import Grammar as SyncodeGrammar

        kwargs = dict(dict(use_cache=False, mode="grammar_strict"), **kwargs)
        return SyncodeLogitsProcessor(SyncodeGrammar(builtin_grammar(grammar).text),
                                      lm.tokenizer, **kwargs)
    return make


def outlines_generator(lm, grammar: str):
    import outlines

    model = outlines.from_transformers(lm.model, lm.tokenizer)
    return outlines.Generator(model, outlines.types.CFG(builtin_grammar(grammar).text))


def wrap(lm, backend: str, grammar: str, syncode_cls=None, controller=None, **kwargs):
    """The backend's wrapper around a fresh user processor, with the matching controller."""
    controller = controller if controller is not None else fitted(lm, backend, grammar)[1]
    if backend == "xgrammar":
        from shim_xgrammar.wrap import with_shim

        return with_shim(xgrammar_processor(lm, grammar), controller, tokenizer=lm.tokenizer,
                         **kwargs)
    if backend == "syncode":
        from shim_syncode.wrap import with_shim

        sp_kwargs = {"num_samples": kwargs.pop("num_samples")} if "num_samples" in kwargs else {}
        return with_shim(syncode_cls(lm, grammar, **sp_kwargs), controller, **kwargs)
    if backend == "outlines":
        from shim_outlines.wrap import with_shim

        return with_shim(outlines_generator(lm, grammar), controller, **kwargs)
    raise AssertionError(backend)


def sample(lm, processor, prompt: str, n: int, seed: int, **extra) -> list[str]:
    enc = lm.tokenizer([prompt] * n, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = lm.model.generate(**enc, logits_processor=[processor], max_new_tokens=48,
                                eos_token_id=EOS, pad_token_id=EOS,
                                **dict(FAITHFUL_SAMPLING, **extra))
    return [lm.tokenizer.decode([t for t in row[enc["input_ids"].shape[1]:].tolist()
                                 if t != EOS]) for row in out]


# ---- outputs are in the language; reset between calls ----------------------------------------
@pytest.mark.parametrize("backend,grammar", [("xgrammar", "binary5"), ("syncode", "bv4")])
def test_plain_wrapper_outputs_are_in_the_language_and_reset_works(lm, backend, grammar):
    masker, controller = fitted(lm, backend, grammar)
    accepts = reference_acceptor(masker.grammar).accepts
    processor = shim_logits_processor(masker, controller)
    first = sample(lm, processor, masker.grammar.default_prompt, 4, seed=0)
    processor.reset()
    second = sample(lm, processor, masker.grammar.default_prompt, 2, seed=1)  # other batch size
    assert len(first) == 4 and len(second) == 2
    assert all(accepts(t) for t in first + second), first + second


def test_plain_wrapper_without_reset_refuses_the_next_call(lm):
    masker, controller = fitted(lm, "xgrammar", "binary5")
    processor = shim_logits_processor(masker, controller)
    sample(lm, processor, masker.grammar.default_prompt, 2, seed=0)
    with pytest.raises(UnsupportedDecodingError, match="reset"):
        sample(lm, processor, masker.grammar.default_prompt, 2, seed=0)


@pytest.mark.parametrize("backend,grammar", [("xgrammar", "binary5"), ("xgrammar", "bv4"),
                                             ("syncode", "binary5")])
def test_processor_wrappers_output_the_language_and_reset(lm, syncode_cls, backend, grammar):
    g = builtin_grammar(grammar)
    accepts = reference_acceptor(g).accepts
    processor = wrap(lm, backend, grammar, syncode_cls)
    first = sample(lm, processor, g.default_prompt, 3, seed=0)
    processor.reset()
    second = sample(lm, processor, g.default_prompt, 2, seed=1)
    assert all(accepts(t) for t in first + second), first + second


@pytest.mark.parametrize("grammar", ["binary5", "bv4"])
def test_outlines_wrapper_keeps_the_call_signature_and_outputs_the_language(lm, grammar):
    g = builtin_grammar(grammar)
    accepts = reference_acceptor(g).accepts
    generator = wrap(lm, "outlines", grammar)
    kwargs = dict(max_new_tokens=48, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    torch.manual_seed(0)
    one = generator(g.default_prompt, **kwargs)  # __call__: one string
    many = generator.batch([g.default_prompt] * 3, **kwargs)  # batch: a list (reset inside)
    assert isinstance(one, str) and isinstance(many, list) and len(many) == 3
    assert all(accepts(t) for t in [one, *many]), [one, *many]


def binary5_regex() -> Grammar:
    strings = re.findall(r'"([01]{5})"', builtin_grammar("binary5").text)
    return Grammar(text="(" + "|".join(strings) + ")", format="regex", name="binary5-regex",
                   default_prompt=builtin_grammar("binary5").default_prompt)


@pytest.fixture(scope="module")
def regex_setup(lm):
    """outlines_core path: a regex grammar, its controller, and an outlines Regex generator."""
    import outlines

    grammar = binary5_regex()
    masker = get_backend("outlines").compile(grammar, lm.tokenizer, lm.vocab_size)
    controller = fit_controller(lm, masker, seed=3, **FIT)

    def generator():
        model = outlines.from_transformers(lm.model, lm.tokenizer)
        return outlines.Generator(model, outlines.types.Regex(grammar.text))
    return grammar, masker, controller, generator


def test_outlines_regex_wrapper_outputs_the_language(lm, regex_setup):
    from shim_outlines.wrap import with_shim

    grammar, _, controller, generator = regex_setup
    accepts = reference_acceptor(grammar).accepts
    assert accepts("00100") and not accepts("00000")
    wrapped = with_shim(generator(), controller, grammar=grammar)
    torch.manual_seed(0)
    texts = wrapped.batch([grammar.default_prompt] * 3, max_new_tokens=12, do_sample=True,
                          top_k=0)
    assert all(accepts(t) for t in texts), texts


# ---- the wrapper changes the distribution exactly as ShimLogitsProcessor does ----------------
def _forced_walk(lm, masker, controller, step_fn, prompt: str, rows: int, steps: int = 24):
    """Drive the wrapper (``step_fn``) and ShimLogitsProcessor over the same rows and logits.

    Each step both see identical input_ids and logits (seeded noise); the next token of each row
    is the reference's argmax. Returns the number of steps where SHIM moved the logits.
    """
    reference = ShimLogitsProcessor([masker.new_state() for _ in range(rows)], controller[0])
    prompt_ids = lm.tokenizer(prompt)["input_ids"]
    ids = torch.tensor([prompt_ids] * rows)
    gen = torch.Generator().manual_seed(7)
    moved = 0
    for step in range(steps):
        logits = torch.randn(rows, lm.vocab_size, generator=gen) * 3
        want = reference(ids, logits.clone())
        got = step_fn(ids, logits.clone())
        masked = torch.isneginf(want)
        assert torch.equal(torch.isneginf(got), masked), f"masked sets differ at step {step}"
        diff = (got - want)[~masked].abs().max().item()
        assert diff <= 1e-5, f"step {step}: max |wrapper - ShimLogitsProcessor| = {diff}"
        plain = logits.masked_fill(masked, float("-inf"))
        moved += int(((want - plain)[~masked].abs() > 1e-3).any())
        nxt = want.argmax(dim=-1)
        nxt = torch.where(torch.tensor([s.is_finished for s in reference.states]),
                          torch.full_like(nxt, EOS), nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if all(s.is_finished for s in reference.states):
            break
    return moved


@pytest.mark.parametrize("backend,grammar", [("xgrammar", "binary5"), ("xgrammar", "bv4"),
                                             ("syncode", "binary5"), ("outlines", "binary5"),
                                             ("outlines", "bv4"), ("plain", "bv4")])
def test_wrapper_scores_equal_shim_logits_processor(lm, syncode_cls, backend, grammar):
    if backend == "plain":
        masker, controller = fitted(lm, "xgrammar", grammar)
        step_fn = shim_logits_processor(masker, controller, batch_size=3)
    else:
        masker, controller = fitted(lm, backend, grammar)
        wrapped = wrap(lm, backend, grammar, syncode_cls,
                       **({"num_samples": 3} if backend == "syncode" else {}))
        step_fn = wrapped.logits_processor if backend == "outlines" else wrapped
    moved = _forced_walk(lm, masker, controller, step_fn, masker.grammar.default_prompt, rows=3)
    assert moved > 0, "the controller never changed the logits: the comparison proves nothing"


@pytest.mark.parametrize("grammar", ["binary5", "json"])
def test_xgrammar_wrapper_scores_equal_shim_logits_processor_at_batch_6(lm, syncode_cls,
                                                                       grammar):
    """Past four rows the XGrammar wrapper compares the fix-up words with array ops (and
    asks is_completed only where XGrammar allows EOS): still the same logits, step by step,
    as rows finish."""
    masker, controller = fitted(lm, "xgrammar", grammar)
    wrapped = wrap(lm, "xgrammar", grammar, syncode_cls)
    moved = _forced_walk(lm, masker, controller, wrapped, masker.grammar.default_prompt, rows=6)
    assert moved > 0, "the controller never changed the logits: the comparison proves nothing"


def test_outlines_regex_wrapper_scores_equal_shim_logits_processor(lm, regex_setup):
    from shim_outlines.wrap import with_shim

    grammar, masker, controller, generator = regex_setup
    wrapped = with_shim(generator(), controller, grammar=grammar)
    moved = _forced_walk(lm, masker, controller, wrapped.logits_processor, grammar.default_prompt,
                         rows=3)
    assert moved > 0


# ---- beam search and reordered rows are refused ----------------------------------------------
def _beam(lm, processor, prompt):
    enc = lm.tokenizer([prompt], return_tensors="pt")
    with torch.no_grad():
        lm.model.generate(**enc, logits_processor=[processor], num_beams=2, do_sample=False,
                          max_new_tokens=6, eos_token_id=EOS, pad_token_id=EOS)


@pytest.mark.parametrize("backend", ["plain", "xgrammar", "syncode"])
def test_beam_search_is_refused(lm, syncode_cls, backend):
    prompt = builtin_grammar("binary5").default_prompt
    if backend == "plain":
        masker, controller = fitted(lm, "xgrammar", "binary5")
        processor = shim_logits_processor(masker, controller, batch_size=1)
    else:
        processor = wrap(lm, backend, "binary5", syncode_cls, batch_size=1)
    with pytest.raises(UnsupportedDecodingError, match="beam search"):
        _beam(lm, processor, prompt)


def test_outlines_beam_search_is_refused(lm):
    generator = wrap(lm, "outlines", "binary5")
    with pytest.raises(UnsupportedDecodingError, match="num_beams=2"):
        generator(builtin_grammar("binary5").default_prompt, num_beams=2, max_new_tokens=6)


def test_reordered_rows_are_refused_without_batch_size(lm):
    """Beam search without batch_size= still fails at the first reordering of rows."""
    processor = wrap(lm, "xgrammar", "binary5")
    prompt = lm.tokenizer(builtin_grammar("binary5").default_prompt)["input_ids"]
    one, zero = (lm.tokenizer.convert_tokens_to_ids(c) for c in ("1", "0"))
    ids = torch.tensor([prompt, prompt])
    processor(ids, torch.zeros(2, lm.vocab_size))
    ids = torch.cat([ids, torch.tensor([[one], [zero]])], dim=1)
    processor(ids, torch.zeros(2, lm.vocab_size))
    swapped = torch.cat([ids[[1, 0]], torch.tensor([[one], [one]])], dim=1)
    with pytest.raises(UnsupportedDecodingError, match="row 0 no longer continues"):
        processor(swapped, torch.zeros(2, lm.vocab_size))


# ---- controllers for another backend / grammar are refused -----------------------------------
@pytest.mark.parametrize("backend,other", [("xgrammar", "syncode"), ("syncode", "xgrammar"),
                                           ("outlines", "xgrammar"), ("plain", "outlines")])
def test_controller_of_another_backend_is_refused(lm, syncode_cls, backend, other):
    _, foreign = fitted(lm, other, "binary5")
    with pytest.raises(ManifestMismatchError) as err:
        if backend == "plain":
            shim_logits_processor(fitted(lm, "xgrammar", "binary5")[0], foreign)
        else:
            wrap(lm, backend, "binary5", syncode_cls, controller=foreign)
    assert err.value.field == "backend"
    assert err.value.found == other


def test_controller_artefact_directory_is_checked_on_load(lm, tmp_path):
    from shim_xgrammar.wrap import with_shim

    masker, (controller, _) = fitted(lm, "xgrammar", "binary5")
    save_controller(tmp_path / "xgr", controller, masker, lm)
    processor = with_shim(xgrammar_processor(lm, "binary5"), tmp_path / "xgr",
                          tokenizer=lm.tokenizer)
    accepts = reference_acceptor(masker.grammar).accepts
    assert all(accepts(t) for t in sample(lm, processor, masker.grammar.default_prompt, 2, 0))
    outlines_masker, (outlines_controller, _) = fitted(lm, "outlines", "binary5")
    save_controller(tmp_path / "ol", outlines_controller, outlines_masker, lm)
    with pytest.raises(ManifestMismatchError, match="'backend'"):
        with_shim(xgrammar_processor(lm, "binary5"), tmp_path / "ol", tokenizer=lm.tokenizer)


def test_controller_without_manifest_is_refused(lm):
    masker, (controller, _) = fitted(lm, "xgrammar", "binary5")
    with pytest.raises(ValueError, match="manifest"):
        shim_logits_processor(masker, controller)


def test_processor_for_another_grammar_is_refused(lm):
    from shim_outlines.wrap import with_shim as outlines_shim
    from shim_xgrammar.wrap import with_shim as xgrammar_shim

    _, binary = fitted(lm, "xgrammar", "binary5")
    with pytest.raises(ValueError, match="not the grammar the controller was fitted for"):
        xgrammar_shim(xgrammar_processor(lm, "bv4"), binary, tokenizer=lm.tokenizer)
    _, outlines_binary = fitted(lm, "outlines", "binary5")
    with pytest.raises(ManifestMismatchError, match="grammar_sha256"):
        outlines_shim(outlines_generator(lm, "bv4"), outlines_binary)


def test_syncode_grammar_mask_mode_is_refused(lm, syncode_cls):
    from shim_syncode.wrap import with_shim

    with pytest.raises(ValueError, match="grammar_strict"):
        with_shim(syncode_cls(lm, "binary5", mode="grammar_mask"),
                  fitted(lm, "syncode", "binary5")[1])


# ---- SynCode stops constraining on bv4: the wrapper refuses instead --------------------------
def _define_prefix(lm):
    prompt = lm.tokenizer(builtin_grammar("bv4").default_prompt)["input_ids"]
    header = lm.tokenizer("(define-fun")["input_ids"]
    assert [lm.tokenizer.decode([t]) for t in header[:2]] == ["(", "define"]
    return [torch.tensor([prompt + header[:k]]) for k in range(3)]


def test_syncode_wrapper_fails_closed_where_syncode_stops_constraining(lm, syncode_cls):
    processor = wrap(lm, "syncode", "bv4", syncode_cls)
    steps = _define_prefix(lm)
    for ids in steps[:2]:
        processor(ids, torch.zeros(1, lm.vocab_size))
    with pytest.raises(BackendDisagreementError, match="step 2, batch row 0"):
        processor(steps[2], torch.zeros(1, lm.vocab_size))


@pytest.mark.xfail(strict=True, reason=(
    "SynCode 0.4.16 upstream bug: SyncodeLogitsProcessor(mode='grammar_strict') on the bv4 "
    "grammar finds no acceptable token after '(define' (inside the literal '(define-fun ...') "
    "and leaves every logit unmasked, i.e. decodes unconstrained from there. Repro: "
    "SyncodeLogitsProcessor(Grammar(bv4_text), tok, mode='grammar_strict') called on "
    "prompt+['(', 'define'] returns no -inf entry."))
def test_upstream_syncode_keeps_constraining_inside_a_literal(lm, syncode_cls):
    processor = syncode_cls(lm, "bv4")
    for ids in _define_prefix(lm):
        scores = processor(ids, torch.zeros(1, lm.vocab_size))
    assert torch.isneginf(scores).any()


# ---- byte tokens that break UTF-8: masked with one warning, never a disagreement -------------
def _byte_id(lm, byte: int) -> int:
    from shim_adapters.mask.vocab import Vocabulary

    table = Vocabulary(lm.tokenizer, lm.vocab_size).token_bytes
    return next(i for i, b in enumerate(table) if b == bytes([byte]))


STRING_REGEX = Grammar(text=r'\["[^"\\]*"\]', format="regex", name="json-string-regex",
                      default_prompt=builtin_grammar("json").default_prompt)


def _string_wrapper(lm, backend: str, syncode_cls):
    if backend == "syncode":
        return wrap(lm, "syncode", "json", syncode_cls)
    import outlines
    from shim_outlines.wrap import with_shim

    key = ("outlines", STRING_REGEX.name)
    if key not in _FITTED:
        masker = get_backend("outlines").compile(STRING_REGEX, lm.tokenizer, lm.vocab_size)
        _FITTED[key] = (masker, fit_controller(lm, masker, seed=3, **dict(
            FIT, n_samples=16, max_new_tokens=16)))
    generator = outlines.Generator(outlines.from_transformers(lm.model, lm.tokenizer),
                                   outlines.types.Regex(STRING_REGEX.text))
    wrapped = with_shim(generator, _FITTED[key][1], grammar=STRING_REGEX)
    return wrapped.logits_processor.shim


@pytest.mark.parametrize("backend", ["syncode", "outlines"])
def test_wrapper_masks_byte_tokens_that_break_utf8_and_keeps_completable_ones(
        lm, syncode_cls, backend):
    """A multi-byte character split into byte tokens inside a JSON string goes through the
    wrapper (no BackendDisagreementError), and tokens that would break UTF-8 for ever are
    masked. outlines' own vocabulary reads partial-UTF-8 tokens as U+FFFD, so its processor
    allows lone continuation bytes in a string and ASCII after a lead byte: the wrapper masks
    them with one ShimWarning naming them instead of failing; SynCode's byte DFAs do the same
    after a lead byte."""
    import warnings

    from shim_adapters.integrations.hf import ShimWarning

    processor = _string_wrapper(lm, backend, syncode_cls)
    prompt = lm.tokenizer(builtin_grammar("json").default_prompt)["input_ids"]
    tokens = lm.tokenizer('["')["input_ids"]
    lead, cont1, cont2, stray, lone = (_byte_id(lm, b) for b in (0xE4, 0xB8, 0xAD, 0xF5, 0xB7))
    a = lm.tokenizer("a")["input_ids"][0]
    row = prompt[:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ShimWarning)
        for step, token in enumerate(tokens + [lead, cont1, cont2]):
            scores = processor(torch.tensor([row]), torch.zeros(1, lm.vocab_size))
            if step >= len(tokens):  # inside the string
                assert not torch.isneginf(scores[0, token])
                assert torch.isneginf(scores[0, stray])
            if step == len(tokens):  # no character begun: a continuation byte never fits
                assert torch.isneginf(scores[0, lone])
            if step > len(tokens):  # after a lead byte
                assert torch.isneginf(scores[0, a])
            row.append(token)
        scores = processor(torch.tensor([row]), torch.zeros(1, lm.vocab_size))
    assert not torch.isneginf(scores[0, a])  # the character is finished: text goes on
    state = processor.states[0]
    assert state.masker.decode(state.token_ids) == '["中'
    messages = [str(w.message) for w in caught if issubclass(w.category, ShimWarning)]
    assert any("invalid UTF-8" in m and repr(b"\xa1") in m for m in messages)
    assert all("invalid UTF-8" in m or "tab token" in m for m in messages)
    if backend == "syncode":  # SynCode also allows a raw tab in the string (read as spaces)
        assert any("tab token" in m for m in messages)


# ---- cut-off samples are reported, never returned as output ----------------------------------
def test_plain_wrapper_reports_rows_cut_off_before_the_grammar_accepts(lm):
    from shim_adapters.integrations.hf import IncompleteSample

    masker, controller = fitted(lm, "xgrammar", "bv4")
    processor = shim_logits_processor(masker, controller, model=lm.model)
    enc = lm.tokenizer([builtin_grammar("bv4").default_prompt] * 2, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = lm.model.generate(**enc, logits_processor=[processor], max_new_tokens=3,
                                eos_token_id=EOS, pad_token_id=EOS, **FAITHFUL_SAMPLING)
    reports = processor.outputs(out)
    assert all(isinstance(r, IncompleteSample) for r in reports), reports
    assert processor.incomplete_rows(out) == [0, 1]
    assert "before the grammar accepted" in str(reports[0])
    assert reports[0].text == lm.tokenizer.decode(out[0, enc["input_ids"].shape[1]:])
    # with room to finish, finished rows come back as text in the language
    processor.reset()
    torch.manual_seed(0)
    with torch.no_grad():
        out = lm.model.generate(**enc, logits_processor=[processor], max_new_tokens=64,
                                eos_token_id=EOS, pad_token_id=EOS, **FAITHFUL_SAMPLING)
    texts = [r for r in processor.outputs(out) if isinstance(r, str)]
    assert texts and all(reference_acceptor(builtin_grammar("bv4")).accepts(t) for t in texts)


def test_outlines_wrapper_returns_incomplete_samples_in_place_of_cut_off_text(lm, syncode_cls):
    import outlines
    from shim_outlines.wrap import with_shim

    from shim_adapters.integrations.hf import IncompleteSample

    _string_wrapper(lm, "outlines", syncode_cls)  # fits the string-regex controller once
    generator = outlines.Generator(outlines.from_transformers(lm.model, lm.tokenizer),
                                   outlines.types.Regex(STRING_REGEX.text))
    wrapped = with_shim(generator, _FITTED[("outlines", STRING_REGEX.name)][1],
                        grammar=STRING_REGEX)
    torch.manual_seed(0)
    cut = wrapped.batch([STRING_REGEX.default_prompt] * 2, max_new_tokens=2, do_sample=True)
    assert len(cut) == 2 and all(isinstance(r, IncompleteSample) for r in cut), cut
    one = wrapped(STRING_REGEX.default_prompt, max_new_tokens=2, do_sample=True)
    assert isinstance(one, IncompleteSample) and one.text.startswith("[")


# ---- the LM the wrapper runs is the controller's ---------------------------------------------
@pytest.fixture(scope="module")
def other_lm(lm, tmp_path_factory):
    """The shipped LM with one weight changed, saved and loaded like any local model."""
    import copy

    from shim_adapters.lm.loading import load_lm

    model = copy.deepcopy(lm.model)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    directory = tmp_path_factory.mktemp("other_lm")
    model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return load_lm(str(directory))


def test_wrappers_refuse_a_model_other_than_the_controllers_lm(lm, other_lm):
    import outlines
    from shim_outlines.wrap import with_shim

    masker, controller = fitted(lm, "xgrammar", "bv4")
    assert controller[1]["lm_revision"] == lm.revision != other_lm.revision
    shim_logits_processor(masker, controller, model=lm.model)  # the same LM: accepted
    with pytest.raises(ManifestMismatchError, match="lm_revision"):
        shim_logits_processor(masker, controller, model=other_lm.model)
    with pytest.raises(ValueError, match="is not the model the wrapper runs"):
        shim_logits_processor(masker, controller, model=other_lm.model, lm=lm)
    _, outlines_bv4 = fitted(lm, "outlines", "bv4")
    generator = outlines.Generator(outlines.from_transformers(other_lm.model, lm.tokenizer),
                                   outlines.types.CFG(builtin_grammar("bv4").text))
    with pytest.raises(ManifestMismatchError, match="lm_revision"):
        with_shim(generator, outlines_bv4)


def test_outlines_regex_wrapper_refuses_a_generator_of_another_regex(lm, regex_setup):
    import outlines
    from shim_outlines.wrap import with_shim

    grammar, _, controller, _ = regex_setup
    other = outlines.Generator(outlines.from_transformers(lm.model, lm.tokenizer),
                               outlines.types.Regex("(00100|11111)"))
    with pytest.raises(ValueError, match="indexes differ"):
        with_shim(other, controller, grammar=grammar)


def test_xgrammar_wrapper_masks_with_the_processors_grammar_without_running_it(lm,
                                                                              monkeypatch):
    """with_shim has checked the processor's compiled grammar is the controller's, so it masks
    with matchers of that very CompiledGrammar and never calls the processor or XGrammar's
    CPU kernel (whose write past a row, the upstream xfail in test_bitmask.py, therefore
    cannot reach the logits); the outputs are in the language, control tokens XGrammar treats
    as text are announced once and never emitted, and a subclass (whose own __call__ would be
    skipped) is refused."""
    import xgrammar as xgr
    from shim_xgrammar.wrap import with_shim
    from xgrammar.contrib.hf import LogitsProcessor

    from shim_adapters.integrations.hf import ShimWarning

    calls = []

    def recording_kernel(logits, bitmask, *args, **kwargs):
        calls.append("kernel")

    def recording_call(self, input_ids, scores):
        calls.append("processor")

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", recording_kernel)
    monkeypatch.setattr(LogitsProcessor, "__call__", recording_call)
    masker, fitted_controller = fitted(lm, "xgrammar", "json")
    processor = xgrammar_processor(lm, "json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ShimWarning)
        wrapped = with_shim(processor, fitted_controller, tokenizer=lm.tokenizer,
                            batch_size=3)
    controls = sorted(masker._special_ids
                      - set(masker.compiled.tokenizer_info.special_token_ids))
    announced = [str(w.message) for w in caught if issubclass(w.category, ShimWarning)]
    assert len(announced) == (1 if controls else 0)
    if controls:
        assert "control token" in announced[0] and str(controls[0]) in announced[0]
    assert wrapped._compiled[0] is processor.compiled_grammars[0]
    enc = lm.tokenizer([builtin_grammar("json").default_prompt] * 3, return_tensors="pt")
    torch.manual_seed(0)
    out = lm.model.generate(**enc, logits_processor=[wrapped], max_new_tokens=24,
                            eos_token_id=EOS, pad_token_id=EOS, **FAITHFUL_SAMPLING)
    assert calls == []
    generated = out[:, enc["input_ids"].shape[1]:]
    assert not set(generated.flatten().tolist()) & set(controls)
    accepts = reference_acceptor(builtin_grammar("json")).accepts
    texts = [o for o in wrapped.outputs(out) if isinstance(o, str)]
    assert texts and all(accepts(t) for t in texts)

    class Custom(LogitsProcessor):
        pass

    with pytest.raises(TypeError, match="LogitsProcessor itself, got Custom"):
        with_shim(Custom(masker.compiled), fitted_controller, tokenizer=lm.tokenizer)


# ---- a prompt outside the fit is named (a warning, never an error) ---------------------------
@pytest.mark.parametrize("how", ["shim_logits_processor", "xgrammar_wrapper"])
def test_wrappers_warn_for_prompt_rows_outside_the_fit(lm, how):
    import warnings

    from shim_adapters.shim.prompt_set import PromptOutsideFitWarning

    masker, controller = fitted(lm, "xgrammar", "binary5")
    fitted_prompt = masker.grammar.default_prompt
    make = ((lambda: shim_logits_processor(masker, controller)) if how == "shim_logits_processor"
            else (lambda: wrap(lm, "xgrammar", "binary5")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromptOutsideFitWarning)
        sample(lm, make(), fitted_prompt, 2, seed=0)  # the fitted prompt: no warning
    # two prompts in one left-padded batch: only the unfitted row is named
    enc = lm.tokenizer.__class__.from_pretrained(lm.tokenizer.name_or_path, padding_side="left")(
        [fitted_prompt, "A longer prompt, never fitted:\n" + fitted_prompt],
        return_tensors="pt", padding=True)
    with pytest.warns(PromptOutsideFitWarning, match=r"row\(s\) 1 is not among the prompt"):
        with torch.no_grad():
            lm.model.generate(**enc, logits_processor=[make()], max_new_tokens=4,
                              eos_token_id=EOS, pad_token_id=EOS, **FAITHFUL_SAMPLING)
