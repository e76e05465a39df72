"""Where masked decoding drifts: for masked samples, the steps where the LM's allowed mass Z
falls below a threshold, with the forbidden tokens the LM wanted most there.

This is the diagnosis behind the Spider results in reports/spider-budget/ (rollout against
final-validity targets): the masker only sees one token ahead, so it allows a token (a name,
``CONCAT``, ``ceil``) after which the LM wants something the grammar forbids (``(`` of a
function call, EOS in an unfinished query); those are the states SHIM must learn to steer away
from.

    python benchmarks/masked_drift_diagnosis.py --data ../shared/benchmarks --suite spider \
        --backend syncode --case spider-0000 --n 64
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.suites import load_suite
from shim_adapters.lm.loading import load_lm
from shim_adapters.lm.sampling import prefill, sample
from shim_adapters.lm.views import stop_folded

FOLDERS = {"bv4": "BV4", "slia": "SLIA", "cp": "CP", "spider": "spider"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the benchmarks folder")
    p.add_argument("--suite", default="spider", choices=sorted(FOLDERS))
    p.add_argument("--backend", default="syncode")
    p.add_argument("--case", required=True)
    p.add_argument("--lm", default="smollm2")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threshold", type=float, default=0.5, help="report steps with Z below")
    p.add_argument("--seed", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    suite = load_suite(a.suite, Path(a.data) / FOLDERS[a.suite])
    case = next(c for c in suite.cases if c.name == a.case)
    base = load_lm(a.lm)
    masker = get_backend(a.backend).compile(case.grammar, base.tokenizer, base.vocab_size)
    lm = stop_folded(base, masker.eos_token_ids)
    tok = lm.tokenizer
    low: dict[int, list] = {}

    class Recorder:
        def record(self, row, step, state, token, logp, mask, log_z):
            if log_z < np.log(a.threshold):
                lp = np.array(logp, dtype=np.float64)
                lp[np.asarray(mask, dtype=bool)] = -np.inf
                top = np.argsort(-lp)[:3]
                low.setdefault(row, []).append(
                    (step, float(np.exp(log_z)),
                     [(tok.decode([int(t)]), round(float(np.exp(lp[t])), 3)) for t in top]))

    s = sample(prefill(lm, case.prompt), a.n, masker=masker, max_new_tokens=a.max_new_tokens,
               batch_size=a.n, generator=torch.Generator().manual_seed(a.seed),
               recorder=Recorder())
    for i, ids in enumerate(s.token_ids):
        print(i, s.finished[i], repr(tok.decode(ids)), f"sumlogZ={sum(s.log_allowed_mass[i]):.2f}")
        for step, z, top in low.get(i, [])[:4]:
            print("     step", step, f"Z={z:.3f}", repr(tok.decode(ids[:step]))[-40:],
                  "wanted", top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
