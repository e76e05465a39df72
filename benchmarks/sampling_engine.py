"""Samples per second of the sampling engine against the loops it replaced, side by side.

Before the engine, training data was drawn by ``training_data.py``'s own loop (the prompt run
once per batch unless the evaluation wrapped the LM in a prompt cache) and evaluation draws by
``evaluation/decoding.py``. Pass ``--old PATH`` (a checkout's ``src`` folder of an earlier
commit, its package renamed ``shim_adapters_old``) to time both in one process, alternating,
with torch on one thread. Reported: samples/s per path, and the engine's phase split.

    python benchmarks/sampling_engine.py --lm smollm2 --old /tmp/oldpkg
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.evaluation.suites import load_suite
    from shim_adapters.evaluation.timing import PhaseTimer
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.lm.sampling import prefill, sample
    from shim_adapters.lm.views import stop_folded
    from shim_adapters.shim.training_data import sample_training_data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm", default="smollm2")
    p.add_argument("--data", default="../shared/benchmarks/BV4")
    p.add_argument("--case", default="find_inv_bvsge_bvashr1_4bit")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--old", default=None, help="folder holding shim_adapters_old")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    case = load_suite("bv4", a.data).select([a.case]).cases[0]
    lm = load_lm(a.lm)
    masker = get_backend("xgrammar").compile(case.grammar, lm.tokenizer, lm.vocab_size)
    lm = stop_folded(lm, masker.eos_token_ids)
    old = None
    if a.old:
        sys.path.insert(0, a.old)
        old = importlib.import_module("shim_adapters_old.training_data")
        old_views = importlib.import_module("shim_adapters_old.evaluation.lm_views")
        old_decoding = importlib.import_module("shim_adapters_old.evaluation.decoding")
    results: dict[str, list[float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        results.setdefault(name, []).append(a.n / (time.perf_counter() - t0))

    from transformers import AttentionInterface

    from shim_adapters.lm import views as lm_views

    def use(views) -> None:  # each package's attention reads its own SplitKV class
        AttentionInterface.register(lm_views.GQA_ATTENTION, views._attention_with_split)

    timer = PhaseTimer()
    for r in range(a.repeats):
        gen = dict(seed=r, progress=False, batch_size=a.batch_size)
        if old is not None:
            use(old_views)

            def old_fit_draw(proposal):
                pre = old_decoding.prefill(lm, case.prompt)
                cached = old_views.prompt_cached(lm, pre)
                old.sample_training_data(cached, masker, case.prompt, a.n, max_new_tokens=64,
                                         proposal=proposal, **gen)
            timed("before: training data, masked", lambda: old_fit_draw("masked"))
            timed("before: training data, unconstrained", lambda: old_fit_draw("lm"))
            timed("before: evaluation draws, masked", lambda: old_decoding.decode(
                old_decoding.prefill(lm, case.prompt), a.n, masker=masker, max_new_tokens=64,
                generator=torch.Generator().manual_seed(r)))
        use(lm_views)
        timed("engine: training data, masked", lambda: sample_training_data(
            lm, masker, case.prompt, a.n, max_new_tokens=64, proposal="masked", **gen))
        timed("engine: training data, unconstrained (cut)", lambda: sample_training_data(
            lm, masker, case.prompt, a.n, max_new_tokens=64, proposal="lm", **gen))
        timed("engine: evaluation draws, masked", lambda: sample(
            prefill(lm, case.prompt), a.n, masker=masker, max_new_tokens=64,
            batch_size=a.batch_size, generator=torch.Generator().manual_seed(r), timer=timer))
    out = {k: {"samples_per_second": sorted(v)[len(v) // 2], "runs": v}
           for k, v in results.items()}
    out["engine_phases_seconds"] = {k: float(sum(v)) for k, v in timer.durations.items()}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
