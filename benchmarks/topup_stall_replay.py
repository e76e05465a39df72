"""Replay the top-up stall rule on every top-up a committed fit recorded.

Each controller manifest under ``reports/`` keeps its ``training.rounds``: the held-out target
ESS before and after every top-up and the decision after it. This replays
:func:`shim_adapters.shim.fitting.topup_stalled` on those records, in order, and says where
the rule would have stopped each fit, the LM samples that saves, and whether any fit it stops
ended trusted while the decision at the stop was not (a fit the rule would cost). A record
that never names the evidence band was fitted deciding at the floor (band 1).

    python benchmarks/topup_stall_replay.py [--margin 2] [--out reports/topup-stall]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from shim_adapters.shim.fitting import FitRecipe, topup_stalled

FLOOR = re.compile(r"floor (\d+(?:\.\d+)?)")
BAND = re.compile(r"below (\d+(?:\.\d+)?) x the floor")


def replay(manifest: dict, margin: float) -> dict | None:
    """Where the rule stops one recorded fit (None: the fit drew no top-up)."""
    training = manifest["training"]
    topups = [r for r in training.get("rounds", []) if r.get("kind") == "top-up"]
    if not topups:
        return None
    floor = float(FLOOR.search(topups[0]["reason"]).group(1))
    band = next((float(m.group(1)) for r in topups if (m := BAND.search(r["reason"]))),
                1.0)
    recipe = FitRecipe(evidence_band=band, topup_stall_margin=margin)
    cap = int(training["max_samples"])
    trusted = not training["falls_back_to_masking"]
    row = {"top_ups": len(topups), "lm_samples": int(training["lm_samples_total"]), "cap": cap,
           "ess": [round(topups[0]["heldout_ess_before"], 3)] +
                  [round(r["heldout_ess_after"], 3) for r in topups],
           "trusted": trusted, "stopped_after": None, "saved": 0, "stall": None}
    for k, entry in enumerate(topups, start=1):
        after = entry["heldout_ess_after"]
        thin = after < floor or after < band * floor
        if not thin or entry["lm_samples_total"] >= cap:
            break
        stall = topup_stalled(entry, floor, recipe, cap)
        if stall is not None:
            row.update(stopped_after=k, saved=cap - int(entry["lm_samples_total"]), stall=stall,
                       trusted_at_stop=entry["decision_after"].startswith("correction helps"))
            break
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reports", default="reports")
    p.add_argument("--margin", type=float, default=2.0)
    p.add_argument("--out", default=None, help="folder for replay.json and README.md")
    a = p.parse_args()
    rows = {}
    for path in sorted(Path(a.reports).glob("**/manifest.json")):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if "training" not in manifest:
            continue
        row = replay(manifest, a.margin)
        if row is not None:
            rows[str(path.parent.relative_to(a.reports))] = row
    stopped = {k: r for k, r in rows.items() if r["stopped_after"] is not None}
    costly = sorted(k for k, r in stopped.items() if r["trusted"] and not r["trusted_at_stop"])
    lines = [f"# The top-up stall rule replayed on recorded fits (margin {a.margin:g})", "",
             f"`python benchmarks/topup_stall_replay.py --margin {a.margin:g}`: {len(rows)} "
             f"fits drew top-ups; the rule stops {len(stopped)}, saving "
             f"{sum(r['saved'] for r in stopped.values())} LM samples; fits that ended trusted "
             f"but would not be at the stop: {len(costly)}{' (' + ', '.join(costly) + ')' if costly else ''}.",
             "", "| fit | held-out ESS per top-up | ended | stops after top-up | LM samples "
             "saved |", "|---|---|---|---:|---:|"]
    for k, r in rows.items():
        lines.append(f"| {k} | {' → '.join(f'{e:.3g}' for e in r['ess'])} | "
                     f"{'trusted' if r['trusted'] else 'masking'} | "
                     f"{r['stopped_after'] or '-'} | {r['saved'] or '-'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "README.md").write_text(text)
    return 1 if costly else 0


if __name__ == "__main__":
    raise SystemExit(main())
