"""Merge the matrix results of one run folder into another, problem by problem.

One suite's problems can be split over two processes (``real_lm_matrix.py --only ... --out
B``) so that both cores work; this folds B's problems into A: for every suite folder of B, its
cases replace A's cases of the same name (or are added), with their scores and controllers,
and A's report (tables, plots) is rewritten. The merged report keeps A's command; each case
keeps the options it ran with in its own entries.

    python benchmarks/matrix_merge.py reports/smollm2-matrix-b reports/smollm2-matrix
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def merge_suite(src: Path, dst: Path) -> list[str]:
    """Fold the cases of ``src/report.json`` into ``dst``; returns the merged case names."""
    from shim_adapters.evaluation.report import write_report
    from shim_adapters.evaluation.runner import EvalReport

    incoming = EvalReport.from_json(src / "report.json")
    target = EvalReport.from_json(dst / "report.json")
    if (incoming.lm, incoming.backend) != (target.lm, target.backend):
        raise SystemExit(f"{src}: LM/backend {incoming.lm}/{incoming.backend} differ from "
                         f"{dst}'s {target.lm}/{target.backend}; not merged")
    names = [c["name"] for c in incoming.cases]
    target.cases = [c for c in target.cases if c["name"] not in names] + list(incoming.cases)
    for name in names:
        (dst / "scores").mkdir(exist_ok=True)
        shutil.copy2(src / "scores" / f"{name}.safetensors", dst / "scores")
        if (src / "controllers" / name).is_dir():
            shutil.rmtree(dst / "controllers" / name, ignore_errors=True)
            shutil.copytree(src / "controllers" / name, dst / "controllers" / name)
    write_report(target, dst, plots=True)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="run folder whose suite folders are merged")
    p.add_argument("dst", help="run folder merged into")
    a = p.parse_args(argv)
    for suite_dir in sorted(Path(a.src).iterdir()):
        if (suite_dir / "report.json").is_file():
            names = merge_suite(suite_dir, Path(a.dst) / suite_dir.name)
            print(f"{suite_dir.name}: merged {', '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
