"""Measure the shipped LM: valid fraction of unconstrained samples per built-in grammar, and the
exact binary5 distribution (first digit, mass of the 17 valid strings) by teacher forcing.

    python scripts/default_lm/evaluate.py [--lm DIR] [--samples 500]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.loading import DEFAULT_LM_CONTROL_PROMPTS, load_lm

BINARY5_VALID = ("10111", "10001", "10010", "11001", "10011", "11110", "10101", "11111",
                 "11101", "00100", "11100", "11010", "10110", "00010", "11011", "10100", "11000")


def sample_outputs(lm, prompt: str, n: int, seed: int, max_new_tokens: int = 128,
                   batch: int = 100) -> list[str]:
    """Pure ancestral samples (temperature 1, top-p 1, no top-k) of the text after ``prompt``."""
    torch.manual_seed(seed)
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids
    outs: list[str] = []
    for start in range(0, n, batch):
        k = min(batch, n - start)
        with torch.no_grad():
            gen = lm.model.generate(ids.repeat(k, 1), attention_mask=torch.ones_like(ids).repeat(
                k, 1), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=max_new_tokens, pad_token_id=lm.eos_token_ids[0],
                eos_token_id=list(lm.eos_token_ids))
        outs += lm.tokenizer.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
    return outs


def sequence_logprob(lm, prompt: str, output: str) -> float:
    """log p(output, EOS | prompt), tokens as the tokenizer splits prompt and output."""
    p = lm.tokenizer(prompt).input_ids
    o = lm.tokenizer(output).input_ids + [lm.eos_token_ids[0]]
    ids = torch.tensor([p + o])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(ids).logits[0, :-1].float(), -1)
    return float(sum(logp[len(p) - 1 + i, t] for i, t in enumerate(o)))


def binary5_stats(lm, prompt: str) -> dict:
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        probs = torch.softmax(lm.model(ids).logits[0, -1].float(), -1)
    zero, one = (lm.tokenizer.convert_tokens_to_ids(c) for c in "01")
    strings = {"".join(b): sequence_logprob(lm, prompt, "".join(b))
               for b in itertools.product("01", repeat=5)}
    mass = {s: float(torch.tensor(lp).exp()) for s, lp in strings.items()}
    valid = sum(mass[s] for s in BINARY5_VALID)
    return {"first_token_p0": float(probs[zero]), "first_token_p1": float(probs[one]),
            "first_token_other": float(1 - probs[zero] - probs[one]),
            "mass_32_strings": sum(mass.values()), "mass_17_valid": valid,
            "valid_min_max": [min(mass[s] for s in BINARY5_VALID),
                              max(mass[s] for s in BINARY5_VALID)],
            # masking keeps the first digit's odds, so strings starting with 0 get this share:
            "masked_share_starting_0": float(probs[zero] / (probs[zero] + probs[one])),
            # ... while the target p(x | G) gives them this share:
            "target_share_starting_0": (mass["00100"] + mass["00010"]) / valid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm", default=None)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm = load_lm(args.lm)
    report: dict = {"valid_fraction": {}}
    cases = [(n, b.prompt, n) for n, b in BUILTIN_GRAMMARS.items()]
    cases += [(f"control:{g}", p, g) for g, p in DEFAULT_LM_CONTROL_PROMPTS.items()]
    for label, prompt, grammar in cases:
        acceptor = reference_acceptor(builtin_grammar(grammar))
        outs = sample_outputs(lm, prompt, args.samples, args.seed)
        ok = [acceptor.accepts(o) for o in outs]
        report["valid_fraction"][label] = sum(ok) / len(ok)
        print(f"{label:16s} valid {sum(ok) / len(ok):.3f}", flush=True)
        for o, v in list(zip(outs, ok))[: args.show]:
            print("   ", "ok " if v else "BAD", repr(o))
    for label, prompt in (("binary5", BUILTIN_GRAMMARS["binary5"].prompt),
                          ("control:binary5", DEFAULT_LM_CONTROL_PROMPTS["binary5"])):
        report[f"{label} exact"] = binary5_stats(lm, prompt)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
