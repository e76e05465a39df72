"""End-to-end time per generated token: SHIM vs XGrammar's own HF processor, side by side.

The shipped LM generates under each processor in one run, interleaved per repeat: XGrammar's
``xgrammar.contrib.hf.LogitsProcessor`` (plain masking), the project's ``ShimLogitsProcessor``
over the XGrammar masker, ``shim_xgrammar.wrap.with_shim`` around XGrammar's processor, and
no processor (the LM's own cost). Every run follows the same path, sampled once per repeat
with XGrammar's processor and forced after the processor under test (:class:`ForcePath`, the
same cost in every run), so the runs do identical LM work and differ only in the processor.
Before each timed SHIM run, XGrammar's token-prefix key trie is emptied and one untimed SHIM
run over *another* sampled path warms the γ cache and the trie (the steady state of a long run,
where states recur but the timed path's own prefixes are not all known; ``--cold`` skips the
warm-up, and then new states pay the γ miss).
Time per token = generate wall time / tokens of the path (all rows, EOS once), best of
``--repeats``. The processor columns are the time inside each processor's calls (per token,
best of the repeats), and the last ratios are (LM-only + processor) over the same for
XGrammar: on a machine shared with other jobs they are far less noisy than whole-run wall
times. Torch pinned to one thread.

    python benchmarks/shim_end_to_end.py [--grammars bv4,json] [--batches 1,16,32]
"""

from __future__ import annotations

import argparse
import time

import torch

torch.set_num_threads(1)

import xgrammar as xgr  # noqa: E402

from shim_adapters.controller import fit_controller  # noqa: E402
from shim_adapters.correction import ShimLogitsProcessor  # noqa: E402
from shim_adapters.generation import FAITHFUL_SAMPLING  # noqa: E402
from shim_adapters.grammar import builtin_grammar  # noqa: E402
from shim_adapters.lm import load_lm  # noqa: E402
from shim_adapters.plugins import get_backend  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402


class ForcePath(LogitsProcessor):
    """Forces a recorded path (one token per row and step): appended after the processor
    under test, it makes every run do the same LM work on the same tokens, so the runs differ
    only in the processor (sampling with SHIM would otherwise change the outputs' lengths,
    and time per token with them)."""

    def __init__(self, path: torch.Tensor, prompt_length: int):
        self.path, self.prompt_length = path, prompt_length

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_length
        forced = self.path[:, step]
        allowed = scores.gather(1, forced[:, None])
        if torch.isneginf(allowed).any():
            row = int(torch.nonzero(torch.isneginf(allowed[:, 0]))[0, 0])
            raise RuntimeError(f"the processor under test forbids the recorded token "
                               f"{int(forced[row])} at row {row}, step {step}")
        scores.fill_(float("-inf"))
        scores.scatter_(1, forced[:, None], 0.0)
        return scores


class Timed(LogitsProcessor):
    """Times each call of the processor under test (inside generate: caches as cold as the
    LM's forward pass leaves them)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, []

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter()
        scores = self.inner(input_ids, scores)
        self.seconds.append(time.perf_counter() - t0)
        return scores


def generate(lm, processors, enc, max_new_tokens, eos, seed):
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = lm.model.generate(**enc, logits_processor=LogitsProcessorList(processors),
                                max_new_tokens=max_new_tokens, eos_token_id=eos,
                                pad_token_id=eos[0], **FAITHFUL_SAMPLING)
    return time.perf_counter() - t0, out[:, enc["input_ids"].shape[1]:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammars", default="bv4,json")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cold", dest="warm", action="store_false",
                        help="do not warm the γ cache on each path before timing")
    parser.add_argument("--features", default="position-free",
                        choices=("position-free", "absolute"),
                        help="XGrammar feature readout (the default is position-free)")
    args = parser.parse_args()
    from shim_xgrammar.wrap import with_shim

    lm = load_lm(None)
    backend = get_backend("xgrammar")
    print("| grammar | batch | LM only µs/token | XGrammar HF µs/token | ShimLogitsProcessor "
          "µs/token | ratio | with_shim µs/token | ratio | XGrammar processor µs/token | "
          "ShimLogitsProcessor processor µs/token | with_shim processor µs/token | "
          "ratio (LM + processor) | with_shim ratio (LM + processor) | features |")
    print("|" + "---|" * 15)
    for gname in args.grammars.split(","):
        grammar = builtin_grammar(gname)
        options = {} if args.features == "position-free" else dict(
            start_positions="absolute", position_feature=True)
        masker = backend.compile(grammar, lm.tokenizer, lm.vocab_size, **options)
        controller, manifest = fit_controller(lm, masker, kind="LR_FULL", n_samples=120,
                                              max_new_tokens=64, progress=False, n_splits=2,
                                              beta_grid=(1.0,), reg_grid=(1.0,), seed=0)
        eos = sorted(masker.eos_token_ids)
        for batch in (int(b) for b in args.batches.split(",")):
            enc = lm.tokenizer([grammar.default_prompt] * batch, return_tensors="pt")
            prompt_length = enc["input_ids"].shape[1]
            best = {"lm": float("inf"), "xgr": float("inf"), "shim": float("inf"),
                    "wrap": float("inf")}
            inside = {"xgr": float("inf"), "shim": float("inf"), "wrap": float("inf")}
            for rep in range(args.repeats):
                # the path: XGrammar's own processor, sampled (EOS-padded to full length)
                _, path = generate(lm, [xgr.contrib.hf.LogitsProcessor(masker.compiled)], enc,
                                   args.max_new_tokens, eos, seed=rep)
                tokens = int((path != eos[0]).sum()) + batch
                procs = {
                    "lm": None,
                    "xgr": xgr.contrib.hf.LogitsProcessor(masker.compiled),
                    "shim": ShimLogitsProcessor([masker.new_state() for _ in range(batch)],
                                                controller),
                    "wrap": with_shim(xgr.contrib.hf.LogitsProcessor(masker.compiled),
                                      (controller, manifest), tokenizer=lm.tokenizer,
                                      grammar=grammar, batch_size=batch),
                }
                # another sampled path: it warms the caches the way earlier samples of a
                # long run would, without handing the timed path its own prefixes
                _, other = generate(lm, [xgr.contrib.hf.LogitsProcessor(masker.compiled)], enc,
                                    args.max_new_tokens, eos, seed=1000 + rep)
                for name, proc in procs.items():
                    if name in ("shim", "wrap"):
                        masker.clear_key_trie()  # no prefix of the timed path known
                        if args.warm:  # the γ cache warm on states, as in a long run
                            generate(lm, [ShimLogitsProcessor([masker.new_state()
                                                               for _ in range(batch)],
                                                              controller),
                                          ForcePath(other, prompt_length)], enc,
                                     other.shape[1], eos, seed=rep)
                    force = ForcePath(path, prompt_length)
                    timed = None if proc is None else Timed(proc)
                    seconds, out = generate(lm, [force] if proc is None else [timed, force],
                                            enc, path.shape[1], eos, seed=rep)
                    if not torch.equal(out, path[:, :out.shape[1]]):
                        raise RuntimeError(f"{name}: the forced run left the recorded path")
                    best[name] = min(best[name], seconds / tokens)
                    if timed is not None:
                        inside[name] = min(inside[name], sum(timed.seconds) / tokens)
            x, lm_only = best["xgr"], best["lm"]
            # the same ratios from the LM-only run plus each processor's own time (robust to
            # the other jobs on a loaded machine: processor calls are short)
            est = {k: lm_only + v for k, v in inside.items()}
            print(f"| {gname} | {batch} | {lm_only * 1e6:.0f} | {x * 1e6:.0f} | "
                  f"{best['shim'] * 1e6:.0f} | {best['shim'] / x:.3f} | "
                  f"{best['wrap'] * 1e6:.0f} | {best['wrap'] / x:.3f} | "
                  f"{inside['xgr'] * 1e6:.1f} | {inside['shim'] * 1e6:.1f} | "
                  f"{inside['wrap'] * 1e6:.1f} | {est['shim'] / est['xgr']:.3f} | "
                  f"{est['wrap'] / est['xgr']:.3f} | {args.features} |", flush=True)
    print(f"\nbest of {args.repeats} repeats; {args.max_new_tokens} new tokens; torch threads "
          f"= {torch.get_num_threads()}; γ cache {'warm' if args.warm else 'cold'} on each path")


if __name__ == "__main__":
    main()
