"""Per-step cost of the ``outlines`` plugin vs calling outlines_core / llguidance directly.

Replays the same token sequences (seeded random walks over the mask) through
- the engine directly, as outlines 1.3 drives it: outlines_core ``Guide.advance`` +
  ``write_mask_into`` (packed int32 bitmask); llguidance ``consume_token`` +
  ``fill_next_token_bitmask``;
- the plugin's ``MaskerState``: ``allowed_mask()`` (bool over the full logit width),
  ``advance()`` (incl. the shadow parser for CFGs) and ``features()``.
Phases are timed per step side by side in one run (median / p95, microseconds) for a JSON schema
(outlines_core) and the bv4 grammar (llguidance), at GPT-2 (50k) and Qwen2.5 (152k) vocabularies.

    python benchmarks/outlines_cost.py [--walks 20] [--steps 120]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np  # noqa: E402

SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
})

TOKENIZERS = (("gpt2", 50304), ("qwen2.5", 151936))


def _walks(masker, tokenizer, n_walks: int, max_steps: int, seed: int = 0) -> list[list[int]]:
    """Seeded random walks over the plugin's mask (biased to end: EOS, punctuation)."""
    from shim_outlines.vocabulary import token_bytes_table

    table = token_bytes_table(tokenizer)
    plain = np.array([d is not None and not any(chr(c).isalnum() for c in d) for d in table])
    plain = np.concatenate([plain, np.zeros(masker.vocab_size - len(plain), bool)])
    eos = min(masker.eos_token_ids)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_walks):
        state = masker.new_state()
        for _ in range(max_steps):
            ids = np.flatnonzero(state.allowed_mask())
            if state.eos_allowed() and rng.random() < 0.3:
                break
            ids = ids[~np.isin(ids, list(masker.eos_token_ids))]
            if not len(ids):
                break
            pool = ids[plain[ids]] if rng.random() < 0.5 and plain[ids].any() else ids
            state.advance(int(rng.choice(pool)))
        out.append([t for t in state.token_ids if t != eos])
    return out


def _stats(ns: list[int]) -> tuple[float, float]:
    arr = np.asarray(ns, dtype=np.float64) / 1e3
    return float(np.median(arr)), float(np.percentile(arr, 95))


def _time_plugin(masker, walks) -> dict[str, list[int]]:
    t = time.perf_counter_ns
    res: dict[str, list[int]] = {"mask": [], "advance": [], "features": []}
    for walk in walks:
        state = masker.new_state()
        for token in walk:
            a = t(); state.allowed_mask(); b = t()
            state.features(); c = t()
            state.advance(token); d = t()
            res["mask"].append(b - a); res["features"].append(c - b)
            res["advance"].append(d - c)
    return res


def _time_outlines_core(masker, walks) -> dict[str, list[int]]:
    from outlines_core import Guide

    # What outlines_core.kernels.{numpy,torch}.fill_next_token_bitmask do, minus their checks
    # (the numpy kernel module also needs numba, which is not installed here).
    t = time.perf_counter_ns
    res: dict[str, list[int]] = {"mask": [], "advance": []}
    bitmask = np.full((1, (masker.vocab_size + 31) // 32), -1, dtype=np.int32)
    ptr, size = bitmask.ctypes.data, bitmask.size
    for walk in walks:
        guide = Guide(masker.index)
        for token in walk:
            a = t(); guide.write_mask_into(ptr, size, 4); b = t()
            guide.advance(token, return_tokens=False); c = t()
            res["mask"].append(b - a); res["advance"].append(c - b)
    return res


def _time_llguidance(masker, walks) -> dict[str, list[int]]:
    import llguidance
    import llguidance.numpy

    t = time.perf_counter_ns
    res: dict[str, list[int]] = {"mask": [], "advance": []}
    bitmask = llguidance.numpy.allocate_token_bitmask(1, masker.ll_tokenizer.vocab_size)
    for walk in walks:
        matcher = llguidance.LLMatcher(masker.ll_tokenizer, masker.grammar_spec, log_level=0)
        for token in walk:
            a = t(); llguidance.numpy.fill_next_token_bitmask(matcher, bitmask); b = t()
            matcher.consume_token(token); c = t()
            res["mask"].append(b - a); res["advance"].append(c - b)
    return res


def _time_shadow_only(masker, walks) -> dict[str, list[int]]:
    """The shadow parser's share of advance(): feeding the token's bytes alone."""
    t = time.perf_counter_ns
    res: dict[str, list[int]] = {"shadow_feed": []}
    for walk in walks:
        shadow = masker.shadow.new_parser()
        for token in walk:
            a = t(); shadow.feed_bytes(masker.token_bytes[token]); b = t()
            res["shadow_feed"].append(b - a)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()

    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import Grammar, builtin_grammar
    from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer

    backend = get_backend("outlines")
    rows = []
    compile_rows = []
    for tok_name, width in TOKENIZERS:
        tokenizer = load_offline_tokenizer(tok_name)
        for grammar in (Grammar(SCHEMA, "json_schema", "schema"), builtin_grammar("bv4")):
            a = time.perf_counter()
            masker = backend.compile(grammar, tokenizer, width)
            compile_s = time.perf_counter() - a
            a = time.perf_counter()
            backend.compile(grammar, tokenizer, width)
            recompile_s = time.perf_counter() - a
            compile_rows.append((tok_name, grammar.name, compile_s, recompile_s))
            walks = _walks(masker, tokenizer, args.walks, args.steps)
            n_steps = sum(map(len, walks))
            _time_plugin(masker, walks)  # warm: per-state mask memo, allocator
            plugin = _time_plugin(masker, walks)
            if grammar.format == "json_schema":
                direct = _time_outlines_core(masker, walks)
                engine = "outlines_core"
            else:
                direct = _time_llguidance(masker, walks)
                engine = "llguidance"
                plugin.update(_time_shadow_only(masker, walks))
            rows.append((tok_name, grammar.name, engine, n_steps, plugin, direct))

    print("\ncompile (s): first build incl. tokenizer-level caches | rebuild (cache hit)")
    for tok_name, gname, first, again in compile_rows:
        print(f"  {tok_name:8s} {gname:7s} {first:8.3f} | {again:8.3f}")

    print("\nper-step cost, microseconds (median / p95); ratio = plugin median / direct median")
    header = (f"{'vocab':8s} {'grammar':7s} {'engine':13s} {'steps':>5s} | "
              f"{'direct mask':>14s} {'direct adv':>12s} | {'plugin mask':>14s} "
              f"{'plugin adv':>14s} {'features':>12s} {'shadow':>12s} | "
              f"{'mask x':>6s} {'adv x':>6s} {'step x':>7s} {'step+feat x':>11s}")
    print(header)
    print("-" * len(header))
    for tok_name, gname, engine, n_steps, plugin, direct in rows:
        dm, dm95 = _stats(direct["mask"])
        da, da95 = _stats(direct["advance"])
        pm, pm95 = _stats(plugin["mask"])
        pa, pa95 = _stats(plugin["advance"])
        pf, pf95 = _stats(plugin["features"])
        shadow = (f"{_stats(plugin['shadow_feed'])[0]:5.1f}/{_stats(plugin['shadow_feed'])[1]:5.1f}"
                  if "shadow_feed" in plugin else "-")
        print(f"{tok_name:8s} {gname:7s} {engine:13s} {n_steps:5d} | "
              f"{dm:6.1f}/{dm95:6.1f} {da:5.1f}/{da95:5.1f} | {pm:6.1f}/{pm95:6.1f} "
              f"{pa:6.1f}/{pa95:6.1f} {pf:5.1f}/{pf95:5.1f} {shadow:>12s} | "
              f"{pm / dm:6.2f} {pa / da:6.2f} {(pm + pa) / (dm + da):7.2f} "
              f"{(pm + pa + pf) / (dm + da):11.2f}")
    print("\nshadow = the shadow LALR parser's share of plugin advance (CFG only); "
          "direct mask = packed int32 bitmask, plugin mask = bool over the full logit width.")


if __name__ == "__main__":
    main()
