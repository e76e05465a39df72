"""The engine samples SHIM's distribution: binary5 on the shipped LM, the exact distribution
the core computes for the same artefact (``enumerate_language`` with a ``ShimAdjuster``, the
per-step distribution of ``ShimLogitsProcessor``) against 2,000 samples from the server.

A chi-square goodness-of-fit test at a false-alarm rate of 1e-3 (17 strings, 16 degrees of
freedom; every expected count is well above 5 here). Such a test passes vacuously if it cannot
tell anything apart, so the test first checks its own power: against plain masking's exact
distribution (what the server would sample if the correction were lost) and against a
correction applied twice (2·β), a sample of this size is rejected with probability > 0.99.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_server import completion, post_many

pytestmark = pytest.mark.engine

N_SAMPLES = 2000
FALSE_ALARM = 1e-3
MIN_POWER = 0.99


@pytest.fixture(scope="module")
def exact(lm, engine_artefacts):
    """Exact string distributions of the target, masking, SHIM and a doubled SHIM."""
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.evaluation.exact_distribution import enumerate_language
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.shim.artefact import load_controller
    from shim_adapters.shim.correction import ShimAdjuster

    grammar = builtin_grammar("binary5")
    masker = get_backend("xgrammar").compile(grammar, lm.tokenizer, lm.vocab_size)
    controller, _ = load_controller(engine_artefacts["binary5"], masker)
    doubled, _ = load_controller(engine_artefacts["binary5"], masker)
    doubled.beta_ = 2 * controller.beta_
    dist = enumerate_language(lm, masker, grammar.default_prompt,
                              {"shim": ShimAdjuster(controller),
                               "shim_twice": ShimAdjuster(doubled)})
    out = {"target": dist.by_string(dist.target())}
    for name in ("masking", "shim", "shim_twice"):
        out[name] = dist.by_string(dist.method(name))
    out["beta"] = controller.beta_
    return out


def _power(p: np.ndarray, q: np.ndarray, n: int) -> float:
    """P(reject | the samples come from q) for the chi-square test of p at size n."""
    from scipy.stats import chi2, ncx2

    df = len(p) - 1
    noncentrality = n * float(np.sum((q - p) ** 2 / p))
    return float(ncx2.sf(chi2.isf(FALSE_ALARM, df), df, noncentrality))


def test_engine_shim_distribution_equals_the_cores(shim_server, engine_artefacts, exact):
    from scipy.stats import chi2

    strings = sorted(exact["shim"])
    p = np.array([exact["shim"][s] for s in strings])
    assert abs(p.sum() - 1) < 1e-6 and len(strings) == 17
    assert N_SAMPLES * p.min() > 5, "expected counts too small for the chi-square test"
    for other in ("masking", "shim_twice"):
        q = np.array([exact[other][s] for s in strings])
        power = _power(p, q, N_SAMPLES)
        assert power > MIN_POWER, (f"the test could not tell SHIM (β={exact['beta']:.2f}) "
                                   f"from {other}: power {power:.3f}")

    payloads = [completion(shim_server, "Generate a binary string of length 5:\n", seed=i,
                           max_tokens=16,
                           shim={"shim_controller": str(engine_artefacts["binary5"])})
                for i in range(N_SAMPLES)]
    replies = post_many(shim_server, payloads, concurrency=64)
    assert all(r.status == 200 for r in replies), [r.body for r in replies if r.status != 200][:3]
    texts = [r.text for r in replies]
    outside = sorted({t for t in texts if t not in exact["shim"]})
    assert not outside, f"outputs outside binary5's language: {outside[:5]}"
    counts = np.array([texts.count(s) for s in strings])
    expected = N_SAMPLES * p
    statistic = float(np.sum((counts - expected) ** 2 / expected))
    p_value = float(chi2.sf(statistic, len(strings) - 1))
    table = "\n".join(f"  {s}: engine {c:4d}  SHIM {e:7.1f}  masking "
                      f"{N_SAMPLES * exact['masking'][s]:7.1f}  target "
                      f"{N_SAMPLES * exact['target'][s]:7.1f}"
                      for s, c, e in zip(strings, counts, expected))
    print(f"\nbinary5, {N_SAMPLES} engine samples, chi2 {statistic:.1f} (p = {p_value:.3g})\n"
          f"{table}")
    assert p_value > FALSE_ALARM, (f"engine samples do not follow the core's SHIM distribution:"
                                   f" chi2 {statistic:.1f}, p = {p_value:.2g}\n{table}")
