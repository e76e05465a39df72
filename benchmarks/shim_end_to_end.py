"""End-to-end time per generated token: SHIM vs each backend's own processor, side by side.

The LM (the shipped one, or ``--lm smollm2``) generates under each processor in one run,
interleaved per repeat: the backend's own processor (plain masking: XGrammar's
``xgrammar.contrib.hf.LogitsProcessor``, SynCode's ``SyncodeLogitsProcessor``, outlines'
``Generator`` processor), the project's ``ShimLogitsProcessor`` over that backend's masker,
the backend's ``with_shim`` around its own processor, the project's ``MaskedLogitsProcessor``
over the same masker without γ (masking only: how much of SHIM's ratio is the project's mask
path rather than γ), and no processor (the LM's own cost).
Every run follows the same path, sampled once per repeat with the backend's own processor and
forced after the processor under test (:class:`ForcePath`, the
same cost in every run), so the runs do identical LM work and differ only in the processor.
Before each timed SHIM run, XGrammar's token-prefix key trie is emptied and one untimed SHIM
run over *another* sampled path warms the γ cache and the trie (the steady state of a long run,
where states recur but the timed path's own prefixes are not all known; ``--cold`` skips the
warm-up, and then new states pay the γ miss).
Time per token = generate wall time / tokens of the path (all rows, EOS once), best of
``--repeats``. The processor columns are the time inside each processor's calls (per token,
best of the repeats), and the last ratios are (LM-only + processor) over the same for the
backend's own processor: on a machine shared with other jobs they are far less noisy than
whole-run wall times. The paired columns take that ratio per repeat (one path, both
processors on it) and report the median over repeats: best-of per processor can pick
different paths, whose lengths and states differ. Torch pinned to one thread.

    python benchmarks/shim_end_to_end.py [--grammars bv4,json] [--batches 1,16,32]
        [--backends xgrammar,syncode,outlines] [--lm smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

torch.set_num_threads(1)

import xgrammar as xgr  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

from shim_adapters.backends.registry import get_backend  # noqa: E402
from shim_adapters.grammars.grammar import builtin_grammar  # noqa: E402
from shim_adapters.lm.generation import FAITHFUL_SAMPLING, MaskedLogitsProcessor  # noqa: E402
from shim_adapters.lm.loading import load_lm  # noqa: E402
from shim_adapters.shim.correction import ShimLogitsProcessor  # noqa: E402
from shim_adapters.shim.fitting import fit_controller  # noqa: E402


class ForcePath(LogitsProcessor):
    """Forces a recorded path (one token per row and step): appended after the processor
    under test, it makes every run do the same LM work on the same tokens, so the runs differ
    only in the processor (sampling with SHIM would otherwise change the outputs' lengths,
    and time per token with them)."""

    def __init__(self, path: torch.Tensor, prompt_length: int, under_test: str = ""):
        self.path, self.prompt_length, self.under_test = path, prompt_length, under_test

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_length
        forced = self.path[:, step]
        allowed = scores.gather(1, forced[:, None])
        if torch.isneginf(allowed).any():
            row = int(torch.nonzero(torch.isneginf(allowed[:, 0]))[0, 0])
            raise RuntimeError(f"the processor under test ({self.under_test}) forbids the "
                               f"recorded token "
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


def backend_processors(backend: str, lm, masker, grammar, controller, manifest, batch,
                       cache_dir: str):
    """(the backend's own processor, with_shim around a fresh one) factories, as users build
    them: XGrammar's HF processor, SynCode's ``SyncodeLogitsProcessor`` (grammar_strict),
    outlines' ``Generator`` logits processor (llguidance for a Lark grammar)."""
    if backend == "xgrammar":
        from shim_xgrammar.wrap import with_shim

        def own():
            return xgr.contrib.hf.LogitsProcessor(masker.compiled)

        def wrap():
            return with_shim(own(), (controller, manifest), tokenizer=lm.tokenizer,
                             grammar=grammar, batch_size=batch)
        return own, wrap
    if backend == "syncode":
        from shim_syncode._syncode_import import syncode_modules
        from shim_syncode.wrap import with_shim

        syncode_modules()
        import syncode.common as common

        common.SYNCODE_CACHE = cache_dir + "/"
        from syncode.grammar_mask.logits_processor import SyncodeLogitsProcessor
        from syncode.parsers.grammars import Grammar as SyncodeGrammar

        def own():
            return SyncodeLogitsProcessor(SyncodeGrammar(grammar.text), lm.tokenizer,
                                          use_cache=True, mode="grammar_strict",
                                          num_samples=batch)

        def wrap():
            return with_shim(own(), (controller, manifest), batch_size=batch)
        return own, wrap
    if backend == "outlines":
        import outlines
        from shim_outlines.wrap import with_shim

        model = outlines.from_transformers(lm.model, lm.tokenizer)
        output_type = {"lark": outlines.types.CFG, "regex": outlines.types.Regex,
                       "json_schema": outlines.types.JsonSchema}[grammar.format](grammar.text)

        def own():
            return outlines.Generator(model, output_type).logits_processor

        def wrap():
            generator = outlines.Generator(model, output_type)
            return with_shim(generator, (controller, manifest), grammar=grammar).logits_processor
        return own, wrap
    raise ValueError(f"unknown backend {backend!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammars", default="bv4,json")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--backends", default="xgrammar",
                        help="comma-separated: xgrammar, syncode, outlines")
    parser.add_argument("--lm", default=None,
                        help="the LM (default: the shipped one; e.g. smollm2)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cold", dest="warm", action="store_false",
                        help="do not warm the γ cache on each path before timing")
    parser.add_argument("--features", default="position-free",
                        choices=("position-free", "absolute"),
                        help="XGrammar feature readout (the default is position-free)")
    args = parser.parse_args()
    import tempfile

    cache_dir = tempfile.mkdtemp(prefix="shim-e2e-syncode-")
    lm = load_lm(args.lm)
    lm_name = args.lm or "shipped"
    print("| LM | backend | grammar | batch | LM only µs/token | backend's own µs/token | "
          "ShimLogitsProcessor µs/token | ratio | with_shim µs/token | ratio | own processor "
          "µs/token | ShimLogitsProcessor processor µs/token | with_shim processor µs/token | "
          "ratio (LM + processor) | with_shim ratio (LM + processor) | masking only processor "
          "µs/token | masking only ratio (LM + processor) | features | paired median ratio: "
          "ShimLogitsProcessor | with_shim | masking only | paired median wall-time ratio: "
          "ShimLogitsProcessor | with_shim | masking only |")
    print("|" + "---|" * 24)
    for backend_name in args.backends.split(","):
        backend = get_backend(backend_name)
        for gname in args.grammars.split(","):
            grammar = builtin_grammar(gname)
            options = {} if args.features == "position-free" or backend_name != "xgrammar" \
                else dict(start_positions="absolute", position_feature=True)
            masker = backend.compile(grammar, lm.tokenizer, lm.vocab_size, **options)
            controller, manifest = fit_controller(lm, masker, kind="LR_FULL", n_samples=120,
                                                  max_new_tokens=64, progress=False,
                                                  n_splits=2, beta_grid=(1.0,),
                                                  reg_grid=(1.0,), seed=0)
            eos = sorted(masker.eos_token_ids)
            clear_trie = getattr(masker, "clear_key_trie", lambda: None)
            features = args.features if backend_name == "xgrammar" else "-"
            for batch in (int(b) for b in args.batches.split(",")):
                own, wrap = backend_processors(backend_name, lm, masker, grammar, controller,
                                               manifest, batch, cache_dir)
                try:
                    row = measure(args, lm, masker, controller, own, wrap, grammar, batch, eos,
                                  clear_trie)
                except Exception as exc:  # a cell that cannot run says why, the rest go on
                    print(f"| {lm_name} | {backend_name} | {gname} | {batch} | not measured: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]} |",
                          flush=True)
                    continue
                lm_only, x, best, inside, est, paired = row
                print(f"| {lm_name} | {backend_name} | {gname} | {batch} | {lm_only * 1e6:.0f} | "
                      f"{x * 1e6:.0f} | {best['shim'] * 1e6:.0f} | {best['shim'] / x:.3f} | "
                      f"{best['wrap'] * 1e6:.0f} | {best['wrap'] / x:.3f} | "
                      f"{inside['own'] * 1e6:.1f} | {inside['shim'] * 1e6:.1f} | "
                      f"{inside['wrap'] * 1e6:.1f} | {est['shim'] / est['own']:.3f} | "
                      f"{est['wrap'] / est['own']:.3f} | {inside['mask'] * 1e6:.1f} | "
                      f"{est['mask'] / est['own']:.3f} | {features} | {paired['shim']:.3f} | "
                      f"{paired['wrap']:.3f} | {paired['mask']:.3f} | {paired['wall_shim']:.3f} | "
                      f"{paired['wall_wrap']:.3f} | {paired['wall_mask']:.3f} |", flush=True)
    print(f"\nbest of {args.repeats} repeats; {args.max_new_tokens} new tokens; torch threads "
          f"= {torch.get_num_threads()}; γ cache {'warm' if args.warm else 'cold'} on each path")


def measure(args, lm, masker, controller, own, wrap, grammar, batch, eos, clear_trie):
    """Best time per token of each processor on one sampled path (see the module docstring)."""
    enc = lm.tokenizer([grammar.default_prompt] * batch, return_tensors="pt")
    prompt_length = enc["input_ids"].shape[1]
    best = {"lm": float("inf"), "own": float("inf"), "shim": float("inf"),
            "wrap": float("inf"), "mask": float("inf")}
    inside = {"own": float("inf"), "shim": float("inf"), "wrap": float("inf"),
              "mask": float("inf")}
    per_rep: list[dict[str, float]] = []  # this repeat's LM-only and processor times
    for rep in range(args.repeats):
        per_rep.append({})
        # the path: the backend's own processor, sampled (EOS-padded)
        _, path = generate(lm, [own()], enc, args.max_new_tokens, eos, seed=rep)
        tokens = int((path != eos[0]).sum()) + batch
        # another sampled path: it warms the caches the way earlier samples of a
        # long run would, without handing the timed path its own prefixes
        _, other = generate(lm, [own()], enc, args.max_new_tokens, eos,
                            seed=1000 + rep)
        for name in ("lm", "own", "mask", "shim", "wrap"):
            if name in ("shim", "wrap"):
                clear_trie()  # no prefix of the timed path known
                if args.warm:  # the γ cache warm on states, as in a long run
                    warm_up = ShimLogitsProcessor([masker.new_state() for _ in range(batch)],
                                                  controller)
                    generate(lm, [warm_up, ForcePath(other, prompt_length, "warm-up SHIM")],
                             enc, other.shape[1], eos, seed=rep)
            proc = {"lm": lambda: None, "own": own, "wrap": wrap,
                    "shim": lambda: ShimLogitsProcessor(
                        [masker.new_state() for _ in range(batch)], controller),
                    "mask": lambda: MaskedLogitsProcessor(
                        [masker.new_state() for _ in range(batch)])
                    }[name]()
            force = ForcePath(path, prompt_length, name)
            timed = None if proc is None else Timed(proc)
            seconds, out = generate(lm, [force] if proc is None else [timed, force],
                                    enc, path.shape[1], eos, seed=rep)
            if not torch.equal(out, path[:, :out.shape[1]]):
                raise RuntimeError(f"{name}: the forced run left the recorded path")
            best[name] = min(best[name], seconds / tokens)
            per_rep[-1][name] = seconds / tokens if timed is None else sum(timed.seconds) / tokens
            per_rep[-1]["wall_" + name] = seconds / tokens
            if timed is not None:
                inside[name] = min(inside[name], sum(timed.seconds) / tokens)
    x, lm_only = best["own"], best["lm"]
    # the same ratios from the LM-only run plus each processor's own time (robust
    # to the other jobs on a loaded machine: processor calls are short)
    est = {k: lm_only + v for k, v in inside.items()}
    # the same ratio per repeat (one path, side by side), then the median over repeats: a
    # best-of per processor may pick different paths, whose lengths and states differ
    paired = {k: statistics.median((r["lm"] + r[k]) / (r["lm"] + r["own"]) for r in per_rep)
              for k in ("shim", "wrap", "mask")}
    # whole-run wall time per repeat, same path: what the processor costs outside its own
    # calls too (garbage collection, caches it evicts for the LM)
    paired.update({"wall_" + k: statistics.median(r["wall_" + k] / r["wall_own"]
                                                  for r in per_rep)
                   for k in ("shim", "wrap", "mask")})
    return lm_only, x, best, inside, est, paired


if __name__ == "__main__":
    main()
