"""How many reference-valid Spider outputs the SynCode masker accepts, and its mask cost.

Samples N unconstrained SmolLM2 completions of one Spider prompt (as the evaluation does:
64 new tokens, a newline ends the output), then per output: does the reference (Lark Earley)
accept the text, and does the masker accept its token sequence followed by EOS? Reported for
the plugin's automatic lexing (dynamic on Spider) and, with ``--basic``, for SynCode's basic
lexer (the old behaviour; compiling its mask store for 49k tokens takes minutes). Mask cost per
step is measured on the accepted outputs, without the mask memo (cold) and with it.

    python benchmarks/spider_syncode_agreement.py [--n 100] [--seed 0] [--basic]
        [--instance /work/shared/benchmarks/spider/instance_0000.txt]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

SPIDER = Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "spider"


def sample_outputs(lm, prompt: str, n: int, seed: int) -> list[list[int]]:
    from shim_adapters.lm.sampling import prefill, sample

    batch = sample(prefill(lm, prompt), n, batch_size=n, max_new_tokens=64,
                   generator=torch.Generator().manual_seed(seed))
    eos = set(getattr(lm, "eos_token_ids", ()) or [lm.tokenizer.eos_token_id])
    outputs = []
    for row in batch.token_ids:
        ids = []
        for t in row:
            if t in eos or "\n" in lm.tokenizer.decode([t]):
                break
            ids.append(int(t))
        outputs.append(ids)
    return outputs


def accepts(masker, ids: list[int], eos: int) -> bool:
    state = masker.new_state()
    for t in ids:
        if not state.allowed_mask()[t]:
            return False
        state.advance(t)
    return bool(state.allowed_mask()[eos])


def mask_ms(masker, outputs: list[list[int]]) -> list[float]:
    times = []
    for ids in outputs:
        state = masker.new_state()
        for t in ids:
            t0 = time.perf_counter()
            state.allowed_mask()
            times.append((time.perf_counter() - t0) * 1e3)
            state.advance(t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instance", default=str(SPIDER / "instance_0000.txt"))
    ap.add_argument("--basic", action="store_true", help="also measure lexing='basic'")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import Grammar
    from shim_adapters.grammars.reference import reference_acceptor
    from shim_adapters.lm.loading import load_lm

    lm = load_lm("smollm2")
    tok = lm.tokenizer
    grammar = Grammar(text=(Path(args.instance).parent / "grammar.lark").read_text(),
                      format="lark", name="spider")
    outputs = sample_outputs(lm, Path(args.instance).read_text(), args.n, args.seed)
    ref = reference_acceptor(grammar)
    texts = [tok.decode(ids) for ids in outputs]
    valid = [ref.accepts(t) for t in texts]
    print(f"{args.n} samples of {args.instance}: reference-valid {sum(valid)}")
    backend = get_backend("syncode")
    modes = ["auto"] + (["basic"] if args.basic else [])
    for mode in modes:
        t0 = time.perf_counter()
        masker = backend.compile(grammar, tok, vocab_size=lm.vocab_size, lexing=mode)
        compile_s = time.perf_counter() - t0
        ok = [accepts(masker, ids, tok.eos_token_id) for ids in outputs]
        both = sum(a and v for a, v in zip(ok, valid))
        unsound = [t for a, v, t in zip(ok, valid, texts) if a and not v]
        print(f"lexing={mode} ({masker.compiled.lexing}): compile {compile_s:.1f}s; accepts "
              f"{sum(ok)}, of them reference-valid {both}/{sum(valid)}; accepted but "
              f"reference-invalid {len(unsound)}")
        for t in unsound[:5]:
            print("   UNSOUND", repr(t))
        for t, a, v in list(zip(texts, ok, valid)):
            if v and not a:
                print("   refused valid:", repr(t))
        good = [ids for ids, a in zip(outputs, ok) if a]
        cold = backend.compile(grammar, tok, vocab_size=lm.vocab_size, lexing=mode,
                               memoize_masks=False)
        c = mask_ms(cold, good)
        w = mask_ms(masker, good)
        if c:
            print(f"   mask ms/step over {len(c)} steps: no memo mean {statistics.mean(c):.1f} "
                  f"median {statistics.median(c):.1f} max {max(c):.0f}; with memo mean "
                  f"{statistics.mean(w):.2f} (second pass over the same outputs)")


if __name__ == "__main__":
    main()
