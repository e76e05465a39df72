"""The fault-injection table (conformance/reports/fault-injection.md): every acceptance fault
of tests/test_fault_injection.py, and no fault, on each of its grammars, one JSON line each.

    python conformance/fault_table.py default > faults-shipped.jsonl
    python conformance/fault_table.py gpt2 > faults-gpt2.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_fault_injection import ACCEPTED, BUDGET, FAULTS, GRAMMARS  # noqa: E402

from shim_adapters.backends.registry import get_backend  # noqa: E402
from shim_adapters.conformance import run_conformance  # noqa: E402
from shim_adapters.conformance.faults import faulty_backend  # noqa: E402


def main(tokenizer: str) -> None:
    for fault in [None, *FAULTS]:
        for name, grammar in GRAMMARS.items():
            spec = "xgrammar" if fault is None else faulty_backend(get_backend("xgrammar"), fault)
            t0 = time.time()
            report = run_conformance(spec, tokenizer, grammar, "fast", accept_known=ACCEPTED,
                                     **BUDGET)
            print(json.dumps({"tokenizer": tokenizer, "fault": fault, "grammar": name,
                              "exit": report.exit_code,
                              "classes": sorted(report.failing_classes()),
                              "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "default")
