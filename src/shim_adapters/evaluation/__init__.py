"""Evaluation harness: fidelity (KL to the grammar-conditioned LM) and cost of every method.

Entry point: :func:`run_eval` (suite x LM x backend x methods -> :class:`EvalReport`), written
by :func:`write_report` as JSON, markdown and plots. The pieces are usable on their own:
exact teacher-forced scoring (:mod:`.scoring`), KL metrics (:mod:`.metrics`), ASAp
(:mod:`.asap`), rejection sampling (:mod:`.rejection`), suites (:mod:`.suites`) and per-phase
timings (:mod:`.timing`).
"""

from shim_adapters.evaluation.asap import AsapTrie, run_asap
from shim_adapters.evaluation.metrics import (
           KLEstimate,
           bootstrap_kl,
           exact_kl,
           kl_over_support,
           stability_curve,
)
from shim_adapters.evaluation.rejection import draw_lm_samples, rejection_sample
from shim_adapters.evaluation.report import write_report
from shim_adapters.evaluation.runner import METHODS, EvalOptions, EvalReport, run_eval
from shim_adapters.evaluation.scoring import score_sequences
from shim_adapters.evaluation.suites import EvalCase, Suite, load_suite

__all__ = ["AsapTrie", "EvalCase", "EvalOptions", "EvalReport", "KLEstimate", "METHODS", "Suite",
           "bootstrap_kl", "draw_lm_samples", "exact_kl", "kl_over_support", "load_suite",
           "rejection_sample", "run_asap", "run_eval", "score_sequences", "stability_curve",
           "write_report"]
