"""Per-step cost of VllmShimLogitsProcessor at a given batch size, on CPU, with vLLM's classes.

Runs a persistent batch the way vLLM's V1 engine drives it: requests arrive through real
``BatchUpdate``s (``BatchUpdateBuilder``), the engine appends each sampled token to the
request's own output list, a finished request leaves and a new one takes its slot. Each step
times, on the same states and logits, side by side:

- ``vllm``: ``update_state`` + ``apply`` of the vLLM processor (states advance inside apply);
- ``core_shim``: ``shim_adapters.shim.correction.ShimLogitsProcessor`` on forks of the same states;
- ``core_mask``: ``shim_adapters.lm.generation.MaskedLogitsProcessor`` (masking only), same forks.

Run in the environment of ``scripts/make_env.sh``::

    python plugins/shim-vllm/benchmarks/bench_vllm_processor.py --batch 64 --steps 150
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def percentile(values, q):
    return float(np.percentile(np.asarray(values) * 1e3, q))


class _Timed:
    """An adjuster whose log_gamma is timed (the controller's part of a step)."""

    def __init__(self, adjuster, wrap):
        self.controller = adjuster.controller
        self.log_gamma = wrap(adjuster.log_gamma)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--n-train", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the summary as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import vllm
    from shim_vllm.processor import VllmShimLogitsProcessor
    from shim_vllm.request_args import parse_request_args
    from vllm import SamplingParams
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder

    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.lm.generation import MaskedLogitsProcessor
    from shim_adapters.lm.loading import default_lm_path, load_lm
    from shim_adapters.shim.correction import ShimLogitsProcessor
    from shim_adapters.shim.fitting import fit_controller

    lm = load_lm(None)
    work = Path(tempfile.mkdtemp(prefix="shim-vllm-bench-"))
    dirs = {}
    for name in ("bv4", "binary5"):
        masker = get_backend("xgrammar").compile(builtin_grammar(name), lm.tokenizer,
                                                 lm.vocab_size)
        fit_controller(lm, masker, kind="LR_FULL", n_samples=args.n_train, seed=args.seed,
                       output_dir=work / name, progress=False)
        dirs[name] = work / name

    config = VllmConfig(model_config=ModelConfig(model=str(default_lm_path()), dtype="float32",
                                                 seed=0),
                        device_config=DeviceConfig(device="cpu"))
    proc = VllmShimLogitsProcessor(config, torch.device("cpu"), False)
    width = proc.bindings.vocab_size
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    outputs: dict[int, list[int]] = {}

    def new_request(builder, index):
        name = "bv4" if rng.random() < 0.75 else "binary5"
        outputs[index] = []
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                extra_args={"shim_controller": str(dirs[name])})
        builder.added.append((index, params, [1, 2, 3], outputs[index]))

    builder = BatchUpdateBuilder()
    for i in range(args.batch):
        new_request(builder, i)
    proc.update_state(builder.get_and_reset(args.batch))

    times = {"vllm": [], "core_shim": [], "core_mask": [], "vllm_controller_share": []}
    controller_seconds = [0.0]

    def timed(log_gamma):
        def call(states, allowed):
            t0 = time.perf_counter()
            try:
                return log_gamma(states, allowed)
            finally:
                controller_seconds[0] += time.perf_counter() - t0
        return call

    for name in dirs:  # time the controller's part of the vLLM processor's apply
        bound = proc.bindings.bind(parse_request_args({"shim_controller": str(dirs[name])}))
        object.__setattr__(bound, "adjuster", _Timed(bound.adjuster, timed))
    replaced = 0
    for step in range(args.steps):
        logits = torch.randn(args.batch, width, generator=gen)
        # the core processors on forks of the states as they are before this step's apply
        for row in proc.rows.values():
            row.sync()
        groups: dict[int, list[int]] = {}
        for i, row in proc.rows.items():
            groups.setdefault(id(row.bound), []).append(i)
        t_shim = t_mask = 0.0
        for members in groups.values():
            bound = proc.rows[members[0]].bound
            forks = [proc.rows[i].state.fork() for i in members]
            ids = torch.zeros((len(members), 1), dtype=torch.long)
            core = ShimLogitsProcessor(forks, bound.adjuster.controller)
            t0 = time.perf_counter()
            core(ids, logits[members].clone())
            t_shim += time.perf_counter() - t0
            forks = [proc.rows[i].state.fork() for i in members]
            plain = MaskedLogitsProcessor(forks)
            t0 = time.perf_counter()
            plain(ids, logits[members].clone())
            t_mask += time.perf_counter() - t0
        work_logits = logits.clone()
        controller_seconds[0] = 0.0
        t0 = time.perf_counter()
        proc.update_state(None)
        out = proc.apply(work_logits)
        times["vllm"].append(time.perf_counter() - t0)
        times["vllm_controller_share"].append(controller_seconds[0])
        times["core_shim"].append(t_shim)
        times["core_mask"].append(t_mask)
        # sample (Gumbel-max at T=1), append to each request's list, replace finished requests
        gumbel = -torch.log(-torch.log(torch.rand(out.shape, generator=gen)))
        sampled = (out + gumbel).argmax(dim=-1).tolist()
        builder = BatchUpdateBuilder()
        for i, token in enumerate(sampled):
            outputs[i].append(int(token))
            state = proc.rows[i].state
            done = int(token) in state.masker.eos_token_ids or len(outputs[i]) >= args.max_tokens
            if done:
                builder.removed_append(i)
                new_request(builder, i)
                replaced += 1
        proc.update_state(builder.get_and_reset(args.batch))

    summary = {
        "vllm_version": vllm.__version__, "torch": torch.__version__, "batch": args.batch,
        "steps": args.steps, "vocab": width, "requests_replaced": replaced,
        "grammars": "bv4 (75%) / binary5 (25%), XGrammar backend, LR_FULL controllers",
    }
    # vllm_controller_share: seconds inside ShimAdjuster.log_gamma (features + controller)
    for name, values in times.items():
        summary[name] = {"p50_ms": percentile(values, 50), "p95_ms": percentile(values, 95),
                         "p99_ms": percentile(values, 99),
                         "mean_ms": statistics.fmean(values) * 1e3}
    summary["vllm_over_core_shim_p50"] = (summary["vllm"]["p50_ms"]
                                          / summary["core_shim"]["p50_ms"])
    summary["vllm_over_core_mask_p50"] = (summary["vllm"]["p50_ms"]
                                          / summary["core_mask"]["p50_ms"])
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
