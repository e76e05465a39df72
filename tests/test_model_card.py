"""The model card says what the fit decided, in words that cannot be misread."""

from shim_adapters.shim.model_card import model_card, summary_lines


def _manifest(fell_back: bool) -> dict:
    return {"grammar_name": "g", "backend": "xgrammar", "backend_version": "0",
            "controller": {"kind": "LR_FULL", "beta": 0.0 if fell_back else 0.8},
            "training": {"heldout_kl_gain": 1.16, "heldout_kl_gain_se": 0.07,
                         "heldout_best_beta": 0.8, "falls_back_to_masking": fell_back,
                         "decision": "d", "target": "rollout", "data_n_samples": 64,
                         "data_valid_fraction": 0.5}}


def test_a_fallback_does_not_read_as_a_gain_of_beta_zero():
    line = summary_lines(_manifest(fell_back=True))[2]
    assert "none used" in line and "best β, 0.8" in line and "1.16 ± 0.07" in line
    assert "(β 0)" not in line
    assert "falls back to plain masking" in summary_lines(_manifest(fell_back=True))[3]


def test_a_used_correction_reports_its_gain_and_beta():
    line = summary_lines(_manifest(fell_back=False))[2]
    assert line == "held-out KL gain over masking: 1.16 ± 0.07 nats (β 0.8)"
    assert line in model_card(_manifest(fell_back=False))
