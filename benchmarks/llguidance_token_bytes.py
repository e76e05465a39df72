"""How many tokens ``llguidance.hf.from_tokenizer`` spells with other bytes than they have.

Compares llguidance's ``decode_bytes`` per token with shim-outlines' byte table for each
tokenizer (2026-12-01, commit 43aaf84: SmolLM2's GGUF-converted tokenizer 32,888 of 49,152;
the seven conformance tokenizers and the shipped one 0)::

    python benchmarks/llguidance_token_bytes.py shipped gpt2 mistral-v1 qwen2.5 llama3 cl100k o200k smollm2
"""

from __future__ import annotations

import argparse


def load(name: str):
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer

    if name in ("shipped", "default"):
        return load_lm(None).tokenizer
    if name == "smollm2":
        return load_lm("smollm2").tokenizer
    return load_offline_tokenizer(name)


def main() -> int:
    import llguidance.hf
    from shim_outlines.vocabulary import llguidance_byte_mismatches

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizers", nargs="+")
    for name in p.parse_args().tokenizers:
        tok = load(name)
        wrong = llguidance_byte_mismatches(llguidance.hf.from_tokenizer(tok), tok,
                                           limit=len(tok))
        print(f"{name}: {len(wrong)} of {len(tok)} tokens misread"
              + (f", e.g. id {wrong[0][0]}: {wrong[0][2]!r} for {wrong[0][1]!r}" if wrong else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
