"""The hot path's small ops timed where they run: inside ``generate``, caches cold.

Each logits-processor call of a ``generate`` run (the shipped LM, unconstrained, 48 new
tokens) times one candidate op, the same op every step of that run, as a real processor would
run it; the candidates take turns run by run (``--rounds`` rounds of ``--runs`` runs each).
The LM's forward pass between two calls evicts the CPU caches, so these costs differ from a
warm micro-benchmark's, and the ranking can flip: torch's kernels are warm (the LM has just
run them), numpy's are not. The hot path's design follows these numbers (``bitmask.py``,
``mask_expansion.py``, ``correction.py``). Times in µs per call (p25 / p50 / p90), torch on
one thread.

    python benchmarks/cold_ops.py [--batch 1] [--runs 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from time import perf_counter_ns

import numpy as np
import torch

torch.set_num_threads(1)

import xgrammar as xgr  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

from shim_adapters.lm.loading import load_lm  # noqa: E402
from shim_adapters.mask.bitmask import bitmask_words  # noqa: E402


class Probe(LogitsProcessor):
    """Times ``op(scores)`` at every call; leaves the scores alone."""

    def __init__(self, op, out: list[int]):
        self.op, self.out = op, out

    def __call__(self, input_ids, scores):
        t0 = perf_counter_ns()
        self.op(scores)
        self.out.append(perf_counter_ns() - t0)
        return scores


def candidates(vocab: int, batch: int) -> dict:
    """name -> op(scores), over a json-like bitmask (40% of tokens allowed)."""
    rng = np.random.default_rng(0)
    words = np.packbits(rng.random((batch, bitmask_words(vocab) * 32)) < 0.4, axis=1,
                        bitorder="little").view(np.int32).copy()
    bitmask = torch.from_numpy(words)
    forbidden = np.unpackbits(words.view(np.uint8), axis=1, count=vocab,
                              bitorder="little") == 0
    forbidden_t = torch.from_numpy(forbidden)
    row_bytes = 4 * words.shape[1]
    data = memoryview(words).cast("B")
    expanded = {data[r * row_bytes:(r + 1) * row_bytes].tobytes(): forbidden_t[r]
                for r in range(batch)}
    full = vocab // 32
    zero = bytes(4 * full)
    scratch = words.copy()  # the word-access ops write: not into the masks above
    items = memoryview(scratch).cast("B").cast("i")
    gamma = torch.randn(batch, vocab)
    gamma_np = gamma.numpy()
    reduce = np.bitwise_or.reduce

    def cached_expansion(scores):
        rows = [expanded[data[r * row_bytes:(r + 1) * row_bytes].tobytes()]
                for r in range(batch)]
        scores.masked_fill_(rows[0] if batch == 1 else torch.stack(rows), float("-inf"))

    def numpy_unpack_copyto(scores):
        bits = np.unpackbits(np.invert(words, order="C").view(np.uint8), axis=1,
                             count=vocab, bitorder="little").view(bool)
        np.copyto(scores.numpy(), -np.inf, where=bits)

    def memcmp_rows(scores):
        for r in range(batch):
            if data[r * row_bytes:r * row_bytes + len(zero)] == zero:
                break

    def three_words_numpy(scores):
        scratch[0, 3] = int(scratch[0, 3]) & -2
        int(scratch[0, 0]) & 1

    def three_words_memoryview(scores):
        items[3] = items[3] & -2
        items[0] & 1

    def gamma_numpy(scores):
        view = scores.numpy()
        view += gamma_np

    return {
        "mask: cached bool rows + masked_fill_": cached_expansion,
        "mask: numpy unpack + copyto": numpy_unpack_copyto,
        "mask: XGrammar's CPU kernel": lambda s: xgr.apply_token_bitmask_inplace(s, bitmask),
        "dead-end check: numpy reduction": lambda s: reduce(words[:, :full], axis=1).all(),
        "dead-end check: bytes compare per row": memcmp_rows,
        "3 word reads/writes: numpy items": three_words_numpy,
        "3 word reads/writes: memoryview": three_words_memoryview,
        "γ add: torch add_": lambda s: s.add_(gamma),
        "γ add: numpy() + numpy add": gamma_numpy,
        "scores.numpy() alone": lambda s: s.numpy(),
        "nothing (the probe itself)": lambda s: None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=6, help="generate runs per op per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    lm = load_lm(None)
    ops = candidates(lm.vocab_size, args.batch)
    times: dict[str, list[int]] = defaultdict(list)
    enc = lm.tokenizer(["Hello"] * args.batch, return_tensors="pt")
    for _ in range(args.rounds):
        for name, op in ops.items():
            for run in range(args.runs):
                torch.manual_seed(run)
                with torch.no_grad():
                    lm.model.generate(**enc, logits_processor=LogitsProcessorList(
                        [Probe(op, times[name])]), max_new_tokens=48, min_new_tokens=48,
                        do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None)
    print(f"| op (batch {args.batch}, vocab {lm.vocab_size}) | p25 µs | p50 µs | p90 µs |")
    print("|---|---|---|---|")
    for name in ops:
        v = sorted(times[name])
        n = len(v)
        print(f"| {name} | {v[n // 4] / 1e3:.1f} | {v[n // 2] / 1e3:.1f} | "
              f"{v[int(n * 0.9)] / 1e3:.1f} |")


if __name__ == "__main__":
    main()
