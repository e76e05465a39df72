"""The prompt as the LM should see it, and where its answer ends.

- :func:`render_prompt`: plain text, or an instruct LM's own chat template (``chat=True``; the
  template already holds the special tokens, so none are added on encoding).
- :func:`detect_line_answers`: few-shot prompts (BV4, SLIA, Spider) are answered on one line,
  after which an instruct LM rarely emits EOS but starts the next example with a newline. When
  the grammar forbids line breaks, masking then forces the LM to keep writing instead of
  stopping. The probe measures it: at the states where the grammar accepts, compare the LM's
  mass on newline tokens (which the masker forbids there) with its mass on EOS. When the
  newline mass is the larger, the answer ends at a newline, and the LM view of
  :func:`~shim_adapters.lm.views.stop_folded` (newline folded into EOS, for every
  method alike) is the faithful one. The decision and its numbers go into the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shim_adapters.lm.sampling import eos_ids, prefill, sample
from shim_adapters.lm.views import newline_token_ids


@dataclass(frozen=True)
class RenderedPrompt:
    """The text fed to the LM and how to encode it."""

    text: str
    add_special_tokens: bool
    chat: bool


def render_prompt(tokenizer, prompt: str, chat: bool = False,
                  system: str | None = None) -> RenderedPrompt:
    """``prompt`` as is, or wrapped in the tokenizer's chat template as one user turn."""
    if not prompt:
        raise ValueError("the prompt is empty; the LM needs at least one token of context")
    if not chat:
        return RenderedPrompt(prompt, True, False)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat: the tokenizer {type(tokenizer).__name__} has no chat "
                         f"template (is this an instruct LM?); drop --chat to use the prompt "
                         f"as plain text")
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return RenderedPrompt(text, False, True)


def prefill_prompt(lm, prompt: str, chat: bool = False):
    """Render and prefill ``prompt`` (see :func:`shim_adapters.lm.sampling.prefill`)."""
    rendered = render_prompt(lm.tokenizer, prompt, chat)
    return prefill(lm, rendered.text, add_special_tokens=rendered.add_special_tokens)


@dataclass
class LineAnswerProbe:
    """Evidence for ending answers at a newline (see the module docstring)."""

    fold: bool
    accepting_steps: int
    newline_mass: float  #: mean LM mass on newline tokens at accepting states
    eos_mass: float  #: mean LM mass on EOS at accepting states
    newline_allowed: bool  #: some newline token was allowed at an accepting state
    reason: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"fold": self.fold, "accepting_steps": self.accepting_steps,
                "newline_mass": self.newline_mass, "eos_mass": self.eos_mass,
                "newline_allowed": self.newline_allowed, "reason": self.reason}


def detect_line_answers(prefilled, masker, *, n_probe: int = 16, max_new_tokens: int = 64,
                        seed: int = 0) -> LineAnswerProbe:
    """Draw ``n_probe`` masked completions and measure, at every state where the grammar
    accepts, the LM's newline vs EOS mass (costs ``n_probe`` short masked samples)."""
    newline = np.array(sorted(set(newline_token_ids(prefilled.lm.tokenizer))
                              - set(eos_ids(prefilled.lm, masker))), dtype=np.int64)
    eos = np.array(sorted(eos_ids(prefilled.lm, masker)), dtype=np.int64)
    nl_mass, eos_mass, allowed_nl = [], [], False

    class _Probe:
        def record(self, row, step, state, token, logp, mask, log_z):
            nonlocal allowed_nl
            if not mask[eos].any():
                return
            nl_mass.append(float(np.exp(logp[newline]).sum()) if len(newline) else 0.0)
            eos_mass.append(float(np.exp(logp[eos]).sum()))
            allowed_nl = allowed_nl or bool(len(newline) and mask[newline].any())

    sample(prefilled, n_probe, masker=masker, max_new_tokens=max_new_tokens,
           batch_size=n_probe, generator=torch.Generator().manual_seed(seed), recorder=_Probe())
    n = len(nl_mass)
    nl = float(np.mean(nl_mass)) if n else 0.0
    eo = float(np.mean(eos_mass)) if n else 0.0
    fold = bool(n and not allowed_nl and nl > eo)
    if not n:
        reason = "no accepting state was reached in the probe: answers end at EOS"
    elif allowed_nl:
        reason = "the grammar allows line breaks where it accepts: answers end at EOS"
    elif fold:
        reason = (f"where the grammar accepts, the LM puts {nl:.3g} on a newline (forbidden "
                  f"there) and {eo:.3g} on EOS: answers end at a newline")
    else:
        reason = (f"where the grammar accepts, the LM puts {eo:.3g} on EOS and {nl:.3g} on a "
                  f"newline: answers end at EOS")
    return LineAnswerProbe(fold, n, nl, eo, allowed_nl, reason)
