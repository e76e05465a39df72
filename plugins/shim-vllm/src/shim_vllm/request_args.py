"""What a request asks of SHIM, read from the engine's per-request free-form arguments.

vLLM passes ``SamplingParams.extra_args`` (``vllm_xargs`` in the OpenAI-compatible server, a
flat dict of strings and numbers), SGLang ``custom_params``; both reach here as a plain dict. The
keys are flat so that they survive the HTTP layer unchanged:

``shim_controller``  (required) directory of a controller artefact on the server's filesystem.
``shim_grammar``     (optional) grammar file the controller was fitted on; needed only when the
                     artefact's grammar is not a built-in one. Its sha256 must match the manifest.
``shim_temperature`` (optional) ``"corrected"`` (default) or ``"lm_only"``: see
                     :data:`TEMPERATURE_MODES`.

A dict without ``shim_controller`` is not a SHIM request and passes through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

CONTROLLER_KEY = "shim_controller"
GRAMMAR_KEY = "shim_grammar"
TEMPERATURE_KEY = "shim_temperature"
KNOWN_KEYS = (CONTROLLER_KEY, GRAMMAR_KEY, TEMPERATURE_KEY)

#: How SHIM's log γ̂ meets the engine's temperature T (engines divide the processed logits by
#: T after custom processors run).
#: ``corrected``: log γ̂ is divided by T with the logits, i.e. temperature tempers the
#: corrected next-token distribution p(x_t | x_<t, G) ≈ softmax(logits + β·log γ̂), exactly as
#: it tempers the LM's own conditional. At T = 1 (the faithful setting) both modes agree.
#: ``lm_only``: the processor multiplies log γ̂ by T first, so after the engine's division the
#: row is logits/T + β·log γ̂: the LM is tempered and the correction is not. (γ̂ was fitted for
#: the untempered LM, so neither mode targets the tempered LM's p_T(x | G) exactly.)
TEMPERATURE_MODES = ("corrected", "lm_only")


class ShimRequestError(ValueError):
    """A request's SHIM arguments are malformed; names the key and what is wrong.

    A ``ValueError`` so that vLLM turns it into an HTTP 400 at validation time.
    """


@dataclass(frozen=True)
class ShimRequestArgs:
    """The SHIM part of one request's arguments, checked for shape (not yet bound)."""

    controller: Path
    grammar: Path | None = None
    temperature_mode: str = "corrected"

    @property
    def binding_key(self) -> tuple[str, str | None]:
        """Requests with equal keys share one compiled masker and one loaded controller."""
        return (str(self.controller), None if self.grammar is None else str(self.grammar))


def parse_request_args(extra_args: Mapping[str, Any] | None) -> ShimRequestArgs | None:
    """The request's SHIM arguments, or None when it asks for no SHIM correction."""
    if not extra_args:
        return None
    if not isinstance(extra_args, Mapping):
        raise ShimRequestError(f"extra_args must be a dict, got {type(extra_args).__name__}")
    stray = sorted(k for k in extra_args if isinstance(k, str) and k.startswith("shim_")
                   and k not in KNOWN_KEYS)
    if CONTROLLER_KEY not in extra_args:
        if stray or any(k in extra_args for k in KNOWN_KEYS):
            present = sorted(k for k in extra_args if str(k).startswith("shim_"))
            raise ShimRequestError(f"extra_args has {present} but no {CONTROLLER_KEY!r}: name "
                                   f"the controller artefact directory to use SHIM")
        return None
    if stray:
        raise ShimRequestError(f"unknown SHIM argument(s) {stray} in extra_args; known: "
                               f"{list(KNOWN_KEYS)}")
    controller = _path(extra_args, CONTROLLER_KEY)
    grammar = _path(extra_args, GRAMMAR_KEY) if extra_args.get(GRAMMAR_KEY) is not None else None
    mode = extra_args.get(TEMPERATURE_KEY, "corrected")
    if mode not in TEMPERATURE_MODES:
        raise ShimRequestError(f"extra_args[{TEMPERATURE_KEY!r}] is {mode!r}; choose one of "
                               f"{list(TEMPERATURE_MODES)}")
    return ShimRequestArgs(controller=controller, grammar=grammar, temperature_mode=mode)


def _path(extra_args: Mapping[str, Any], key: str) -> Path:
    value = extra_args[key]
    if not isinstance(value, str) or not value.strip():
        raise ShimRequestError(f"extra_args[{key!r}] must be a non-empty path string, got "
                               f"{value!r}")
    return Path(value).expanduser().resolve()
