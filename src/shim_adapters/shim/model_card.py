"""A short, human model card beside a fitted controller (the manifest stays the machine record).

It answers what a user asks first: what was this fitted on, does the correction help on
held-out completions, and did it fall back to plain masking.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

MODEL_CARD_FILE = "MODEL_CARD.md"


def _num(value: Any, fmt: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, fmt) if isinstance(value, (int, float)) else str(value)


def summary_lines(manifest: Mapping[str, Any]) -> list[str]:
    """The few lines ``shim fit`` prints."""
    t = manifest.get("training", {})
    c = manifest.get("controller", {})
    gain, se = t.get("heldout_kl_gain"), t.get("heldout_kl_gain_se")
    fell_back = t.get("falls_back_to_masking")
    return [
        f"fitted {c.get('kind')} for grammar {manifest.get('grammar_name')} on "
        f"{manifest.get('backend')} {manifest.get('backend_version')}, LM "
        f"{manifest.get('lm_identifier')}",
        f"training: {t.get('data_n_samples', t.get('n_completions'))} completions, "
        f"{_num(t.get('data_valid_fraction', t.get('valid_fraction')), '.1%')} valid, target "
        f"{t.get('target')}",
        (f"held-out KL gain over masking: none used (the best β, "
         f"{_num(t.get('heldout_best_beta'))}, would gain {_num(gain)} ± {_num(se)} nats: "
         f"not enough evidence)" if fell_back else
         f"held-out KL gain over masking: {_num(gain)} ± {_num(se)} nats (β {_num(c.get('beta'))})"),
        "decision: " + ("falls back to plain masking (β = 0)" if fell_back else
                        "uses the correction") + (f" ({t['decision']})" if t.get("decision")
                                                   else ""),
    ]


def _prompt_line(first: str, prompt: str, prompt_set: Mapping[str, Any] | None) -> str:
    if not prompt_set:
        return f"- prompt: {first!r} ({len(prompt)} characters)"
    return (f"- prompts: a set of {prompt_set.get('size')} from {prompt_set.get('source')} "
            f"(sha256 {str(prompt_set.get('sha256'))[:16]}; trust judged on held-out prompts); "
            f"the first: {first!r}")


def model_card(manifest: Mapping[str, Any], capability=None) -> str:
    """Markdown: what the controller was fitted on, its held-out gain and fallback decision."""
    t = manifest.get("training", {})
    prompt = manifest.get("prompt") or ""
    first = prompt.strip().splitlines()[0] if prompt.strip() else "(none)"
    lines = [f"# SHIM controller: {manifest.get('grammar_name')}", "",
             *(f"- {line}" for line in summary_lines(manifest)), "",
             "## Fitted on", "",
             f"- grammar: {manifest.get('grammar_name')} ({manifest.get('grammar_format')}), "
             f"sha256 {str(manifest.get('grammar_sha256'))[:16]}",
             _prompt_line(first, prompt, t.get("prompt_set")),
             f"- backend: {manifest.get('backend')} {manifest.get('backend_version')}",
             f"- LM: {manifest.get('lm_identifier')} (weights sha256 "
             f"{str(manifest.get('lm_revision'))[:16]}), logits width "
             f"{manifest.get('vocab_size')}, tokenizer sha256 "
             f"{str(manifest.get('tokenizer_sha256'))[:16]}",
             f"- features: " + ", ".join(f"{k} {v}" for k, v in
                                         manifest.get("features", {}).get("feature_status",
                                                                          {}).items()),
             f"- shim-adapters {manifest.get('shim_adapters_version')}", "",
             "## Held-out check", "",
             f"- masking score {_num(t.get('heldout_score_masking'))}, chosen "
             f"{_num(t.get('heldout_score_chosen'))}, effective target samples "
             f"{_num(t.get('heldout_effective_samples'))}",
             f"- decision: {t.get('decision') or 'n/a'}"]
    if capability is not None:
        lines += ["", "## Grammar capability on this backend", "", capability.markdown()]
    lines += ["", "The full record (checked on load) is manifest.json."]
    return "\n".join(lines) + "\n"


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_model_card(directory: str | Path, text: str) -> Path:
    return write_text_atomic(Path(directory) / MODEL_CARD_FILE, text)
