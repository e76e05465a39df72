"""Per-step cost of masks and SHIM's γ, side by side with XGrammar's own fill + accept.

For each tokenizer (the shipped LM's ~1k, GPT-2 50k, Qwen2.5 152k) and grammar (bv4, json),
an LR_FULL controller is fitted (the shipped LM's samples; for the large tokenizers they are
re-tokenised and replayed, as in ``correction_overhead.py``), then ``B`` rows (1 / 16 / 32)
replay masked samples of the shipped LM in lock-step and each decoding step is timed, all
phases in the same loop on the same states:

- ``xgr fill+accept``: XGrammar alone: ``fill_next_token_bitmask`` + ``accept_token`` per row;
- ``plugin fill+advance``: the same through the plugin (``MaskerState.fill_next_token_bitmask``
  + ``advance``);
- ``xgr apply`` / ``core apply``: masking the batch's logits with XGrammar's CPU kernel and with
  the core's (:func:`shim_adapters.mask.bitmask.apply_token_bitmask_`, which shim-xgrammar uses
  on CPU; ``apply_kernel.py`` compares the kernels alone);
- ``γ hit``: ``ShimAdjuster.add_log_gamma_`` on steps where every row hit the warm γ cache;
  ``γ step``: the same over every timed step (misses included);
- ``γ miss``: the same with the cache emptied before the step (the miss path);
- ``γ old``: the previous path (``log_gamma`` on the allowed ids + one index add per row);
- ``summed``: γ and the mask in one add (``ShimAdjuster.add_masked_log_gamma_``, what the
  processors do on CPU at a narrow vocabulary: :mod:`shim_adapters.shim.masked_gamma`), against
  ``two-pass``: ``γ step`` + the plugin's mask apply on the same step. ``γ in summed`` is what
  γ adds to the processor there: ``summed`` minus the plugin's mask apply (p50 each). The
  summed and two-pass paths alternate which runs first each step (the second finds the
  state's key in the trie) and each is reported over the steps where it ran first; so are
  ``γ hit`` and ``γ step``.

The caches (γ and XGrammar's token-prefix key trie) are warmed on one set of masked samples
and the steps timed on a second, fresh set, so a hit pays the state dump wherever the
prefix is new (``trie served``: the share of keys the trie gave without a dump).

γ and the core's kernel get a new logits tensor each step, as inside ``generate`` (timing
them on one tensor reused every step lets ``numpy_view``'s memo serve a view that decoding
never has, and favours numpy over torch).

Hit rates are those of the first (cold) pass over the warm-up samples in batch order. Torch
pinned to one thread. Medians (p50) and p99 in µs per batch step.

    python benchmarks/gamma_mask_cost.py [--samples 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)

import xgrammar as xgr  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from shim_adapters.backends.registry import get_backend  # noqa: E402
from shim_adapters.grammars.grammar import builtin_grammar  # noqa: E402
from shim_adapters.lm.generation import generate_masked  # noqa: E402
from shim_adapters.lm.loading import load_lm  # noqa: E402
from shim_adapters.mask.bitmask import allocate_token_bitmask, apply_token_bitmask_  # noqa: E402
from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer, offline_logits_width  # noqa: E402,E501
from shim_adapters.shim.controller import LR_FULL  # noqa: E402
from shim_adapters.shim.correction import ShimAdjuster  # noqa: E402
from shim_adapters.shim.gamma_cache import GammaCache  # noqa: E402
from shim_adapters.shim.training_data import sample_training_data  # noqa: E402

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("correction_overhead",
                                               _here / "correction_overhead.py")
_co = importlib.util.module_from_spec(_spec)
sys.modules["correction_overhead"] = _co
_spec.loader.exec_module(_co)
replay_texts = _co.replay_texts


def replayable(masker, texts):
    """Token sequences (EOS appended) of ``texts`` that the masker accepts to the end."""
    eos = min(masker.eos_token_ids)
    out = []
    for text in texts:
        ids = masker.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        state = masker.new_state()
        try:
            for t in ids:
                state.advance(t)
        except Exception:
            continue
        out.append(ids)
    return out


def pct(values, q):
    return float(np.percentile(values, q)) * 1e6


def time_batch(masker, adjuster, warm_seqs, seqs, batch):
    """Per-step seconds of each phase over ``seqs`` (rows cycle through them), after one
    untimed pass over ``warm_seqs`` from an empty γ cache and key trie (that pass gives the
    hit rates). The timed sequences are fresh: their prefixes are not all in the key trie and
    their states not all in the γ cache, as in real decoding."""
    width = masker.vocab_size
    bitmask = allocate_token_bitmask(batch, width)
    own_mask = allocate_token_bitmask(batch, width)
    base = torch.randn(batch, width)
    # a spare row: XGrammar's CPU kernel can write one float past a row at widths that are
    # not a multiple of 32 (GPT-2's; docs/upstream-reports.md)
    spare = torch.empty((batch + 1) * width)[:batch * width].view(batch, width)
    times = {k: [] for k in ("xgr own", "xgr apply", "core apply", "plugin mask", "γ hit",
                             "γ step", "γ miss", "γ old", "summed", "two-pass",
                             "plugin apply")}
    step_no = 0
    hit_info = trie_info = None
    adjuster.cache.clear()
    clear_trie = getattr(masker, "clear_key_trie", None)
    if clear_trie is not None:
        clear_trie()
    for p, pass_seqs in enumerate((warm_seqs, seqs)):
        timed = p > 0
        trie_counts = [0, 0]  # keys served by the trie, dumped
        nxt = [r % len(pass_seqs) for r in range(batch)]
        rows = [(masker.new_state(), xgr.GrammarMatcher(masker.compiled), pass_seqs[nxt[r]], 0)
                for r in range(batch)]
        next_seq = batch
        total_steps = sum(len(s) for s in pass_seqs)
        done_steps = 0
        while done_steps < total_steps:
            states = [r[0] for r in rows]
            # XGrammar alone
            logits = spare
            logits.copy_(base)
            t0 = time.perf_counter()
            for r, (_, matcher, seq, i) in enumerate(rows):
                matcher.fill_next_token_bitmask(own_mask, r)
            for r, (_, matcher, seq, i) in enumerate(rows):
                matcher.accept_token(seq[i])
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, own_mask)
            ta = time.perf_counter()
            fresh = base.clone()  # a new tensor per step, as for γ below
            tb = time.perf_counter()
            apply_token_bitmask_(fresh, own_mask)
            tc = time.perf_counter()
            # plugin mask (advance timed below, after γ has read the state). γ gets a new
            # logits tensor each step, as inside generate (a view of the same tensor every
            # step would be served by numpy_view's memo, which decoding never sees)
            logits = base.clone()
            t2 = time.perf_counter()
            for r, state in enumerate(states):
                state.fill_next_token_bitmask(bitmask, r)
            t3 = time.perf_counter()
            # γ, cache as it is (first pass: cold, timed pass: warm from the first), before
            # the mask as the processors do (the mask sets forbidden tokens to -inf after)
            summed_first = step_no % 2 == 0
            step_no += 1
            summed = base.clone()
            if summed_first:
                ts0 = time.perf_counter()
                used_summed = adjuster.add_masked_log_gamma_(summed, states, None, bitmask)
                ts1 = time.perf_counter()
            missed = adjuster.cache.misses + adjuster.cache.encoding_hits
            before = masker.key_trie_info() if clear_trie else {}
            t4 = time.perf_counter()
            adjuster.add_log_gamma_(logits, states)
            t5 = time.perf_counter()
            if timed and clear_trie is not None and not summed_first:  # keys of this call only
                after = masker.key_trie_info()
                trie_counts[0] += after["served"] - before["served"]
                trie_counts[1] += after["dumped"] - before["dumped"]
            tm0 = time.perf_counter()
            masker.apply_token_bitmask_(logits, bitmask)
            tm1 = time.perf_counter()
            if not summed_first:
                ts0 = time.perf_counter()
                used_summed = adjuster.add_masked_log_gamma_(summed, states, None, bitmask)
                ts1 = time.perf_counter()
            if timed:
                times["xgr apply"].append(ta - t1)
                times["core apply"].append(tc - tb)
                times["plugin apply"].append(tm1 - tm0)
                if summed_first and used_summed:
                    times["summed"].append(ts1 - ts0)
                if not summed_first:
                    times["γ step"].append(t5 - t4)
                    times["two-pass"].append(t5 - t4 + tm1 - tm0)
                    if adjuster.cache.misses + adjuster.cache.encoding_hits == missed:
                        times["γ hit"].append(t5 - t4)  # every row of the step hit
                # miss path: the same step with an empty γ cache (encoder caches warm)
                warm = adjuster.cache
                adjuster.cache = GammaCache(warm.controller, damped=warm.damped)
                t6 = time.perf_counter()
                adjuster.add_log_gamma_(logits, states)
                t7 = time.perf_counter()
                adjuster.cache = warm
                times["γ miss"].append(t7 - t6)
                # the previous path: allowed ids, log_gamma, one index add per row
                t8 = time.perf_counter()
                mask = ~torch.isneginf(logits)
                allowed = [np.flatnonzero(m) for m in mask.numpy()]
                lgs = adjuster.log_gamma(states, allowed)
                for r, (ids, lg) in enumerate(zip(allowed, lgs)):
                    logits[r, torch.from_numpy(ids)] += torch.from_numpy(lg).float()
                t9 = time.perf_counter()
                times["γ old"].append(t9 - t8)
            t10 = time.perf_counter()
            for state, (_, _, seq, i) in zip(states, rows):
                state.advance(seq[i])
            t11 = time.perf_counter()
            if timed:
                times["xgr own"].append(t1 - t0)
                times["plugin mask"].append(t3 - t2 + t11 - t10)
            # move rows on; a finished row starts the next sequence
            new_rows = []
            for state, matcher, seq, i in rows:
                done_steps += 1
                if i + 1 < len(seq):
                    new_rows.append((state, matcher, seq, i + 1))
                else:
                    s = pass_seqs[next_seq % len(pass_seqs)]
                    next_seq += 1
                    new_rows.append((masker.new_state(), xgr.GrammarMatcher(masker.compiled),
                                     s, 0))
            rows = new_rows
        if not timed:
            hit_info = adjuster.cache_info()
        elif clear_trie is not None:
            served, dumped = trie_counts
            trie_info = {"served": served / max(1, served + dumped),
                         "nodes": masker.key_trie_info()["nodes"]}
    return times, hit_info, trie_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32,
                        help="masked samples to warm the caches on, and as many fresh ones timed")
    parser.add_argument("--train", type=int, default=150, help="completions to fit on")
    parser.add_argument("--grammars", default="bv4,json")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--features", default="position-free",
                        choices=("position-free", "absolute"),
                        help="XGrammar feature readout (the default is position-free)")
    args = parser.parse_args()
    lm = load_lm(None)
    backend = get_backend("xgrammar")
    options = {} if args.features == "position-free" else dict(start_positions="absolute",
                                                               position_feature=True)
    toks = [("shipped", lm.tokenizer, lm.vocab_size)]
    for name in ("gpt2", "qwen2.5"):
        toks.append((name, load_offline_tokenizer(name), offline_logits_width(name)))
    lines = []
    head = ("| tokenizer | vocab | grammar | batch | xgr fill+accept p50 | plugin fill+advance "
            "p50 | xgr apply p50 | core apply p50 | γ hit p50 | γ hit p99 | γ step p50 | "
            "γ miss p50 | γ old p50 | γ hit / xgr fill+accept | γ step / xgr fill+accept | "
            "two-pass p50 | summed p50 | summed p99 | γ in summed p50 | "
            "γ in summed / xgr fill+accept | "
            "all-hit steps | trie served | hit rate | head-skip rate | cache KiB |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    with threadpool_limits(limits=1):
        for gname in args.grammars.split(","):
            grammar = builtin_grammar(gname)
            own = backend.compile(grammar, lm.tokenizer, lm.vocab_size, **options)
            data = sample_training_data(lm, own, grammar.default_prompt, args.train,
                                        max_new_tokens=96, seed=0, progress=False)
            texts = {}
            for part, seed in (("warm", 1), ("timed", 2)):
                masked = generate_masked(lm.model, lm.tokenizer, own, grammar.default_prompt,
                                         args.samples, max_new_tokens=96, seed=seed)
                texts[part] = [t for t, c in zip(masked.texts, masked.complete) if c]
            for tname, tokenizer, width in toks:
                masker = own if tname == "shipped" else backend.compile(grammar, tokenizer,
                                                                        width, **options)
                d = data if tname == "shipped" else replay_texts(masker, data.texts,
                                                                 data.valid.copy())
                ctrl = LR_FULL(n_splits=2).fit(d)
                warm_seqs = replayable(masker, texts["warm"])
                seqs = replayable(masker, texts["timed"])
                for batch in (int(b) for b in args.batches.split(",")):
                    adjuster = ShimAdjuster(ctrl)
                    times, info, trie = time_batch(masker, adjuster, warm_seqs, seqs, batch)
                    own_p50 = pct(times["xgr own"], 50)
                    hit_p50 = pct(times["γ hit"], 50) if times["γ hit"] else float("nan")
                    step_p50 = pct(times["γ step"], 50)
                    nan = float("nan")
                    summed_p50 = pct(times["summed"], 50) if times["summed"] else nan
                    summed_p99 = pct(times["summed"], 99) if times["summed"] else nan
                    in_summed = summed_p50 - pct(times["plugin apply"], 50)
                    lines.append(
                        f"| {tname} | {width} | {gname} | {batch} | {own_p50:.1f} | "
                        f"{pct(times['plugin mask'], 50):.1f} | "
                        f"{pct(times['xgr apply'], 50):.1f} | "
                        f"{pct(times['core apply'], 50):.1f} | {hit_p50:.1f} | "
                        f"{pct(times['γ hit'], 99) if times['γ hit'] else float('nan'):.1f} | "
                        f"{step_p50:.1f} | {pct(times['γ miss'], 50):.1f} | "
                        f"{pct(times['γ old'], 50):.1f} | {hit_p50 / own_p50:.2f} | "
                        f"{step_p50 / own_p50:.2f} | "
                        f"{pct(times['two-pass'], 50):.1f} | {summed_p50:.1f} | "
                        f"{summed_p99:.1f} | {in_summed:.1f} | {in_summed / own_p50:.2f} | "
                        f"{len(times['γ hit']) / len(times['γ step']):.2f} | "
                        f"{trie['served']:.2f} | "
                        f"{info['hit_rate']:.2f} | {info['head_skip_rate']:.2f} | "
                        f"{info['bytes'] / 1024:.0f} |")
                    print(lines[-1], flush=True)
    print()
    print("\n".join(lines))
    print(f"\nµs per batch step, torch threads = {torch.get_num_threads()}; LR_FULL fitted on "
          f"{args.train} completions; caches warmed on {args.samples} masked samples (that "
          f"cold pass gives the hit rates), timed on {args.samples} fresh ones; "
          f"{args.features} features")


if __name__ == "__main__":
    main()
