"""Fit time, artefact size and held-out quality of each controller kind on bv4.

Samples N unconstrained completions of the bv4 prompt from the shipped LM (or loads them with
--data), fits LR_NT, LR_FULL and MLP on one core and writes each artefact to a temporary
directory. The target is a fit under 60 s and an artefact under 1 MiB for N = 1,000.

    python benchmarks/controller_fit.py [--n 1000] [--backend xgrammar] [--data DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import load_grammar
from shim_adapters.lm.loading import load_lm
from shim_adapters.shim.artefact import MANIFEST_FILE, WEIGHTS_FILE, save_controller
from shim_adapters.shim.controller import CONTROLLERS, make_controller
from shim_adapters.shim.training_data import TrainingData, sample_training_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--grammar", default="bv4")
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--data", type=Path, help="load (or, if missing, save) training data here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    lm = load_lm(None)
    grammar = load_grammar(args.grammar)
    masker = get_backend(args.backend).compile(grammar, lm.tokenizer, lm.vocab_size)
    if args.data is not None and (args.data / "training_data.json").is_file():
        data = TrainingData.load(args.data)
        print(f"loaded {data.n_completions} completions from {args.data}")
    else:
        t0 = time.perf_counter()
        data = sample_training_data(lm, masker, grammar.default_prompt, args.n, seed=args.seed)
        print(f"sampled + replayed {args.n} completions in {time.perf_counter() - t0:.1f} s")
        if args.data is not None:
            data.save(args.data)
    print(f"{data.n_rows} rows, {len(data.states)} distinct states, valid fraction "
          f"{data.valid.mean():.3f}, backend {args.backend}")
    header = f"{'kind':8} {'fit s':>7} {'artefact KiB':>13} {'features':>9} {'reg':>7} " \
             f"{'beta':>5} {'cv logloss':>10} {'gain/step':>10}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in CONTROLLERS:
            t0 = time.perf_counter()
            c = make_controller(kind).fit(data)
            seconds = time.perf_counter() - t0
            out = Path(tmp) / kind
            save_controller(out, c, masker, lm, prompt=grammar.default_prompt)
            size = ((out / WEIGHTS_FILE).stat().st_size + (out / MANIFEST_FILE).stat().st_size)
            print(f"{kind:8} {seconds:7.2f} {size / 1024:13.1f} {c.n_features_in_:9d} "
                  f"{c.reg_:7.3g} {c.beta_:5.2f} {c.cv_log_loss_:10.4f} "
                  f"{c.contrast_gain_per_step_:10.4f}")
    print("fit budget: 60 s on one core; artefact budget: 1024 KiB")


if __name__ == "__main__":
    main()
