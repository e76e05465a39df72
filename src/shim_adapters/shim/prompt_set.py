"""A prompt set: the prompts one controller of a grammar is fitted on.

A served grammar meets a different prompt on every request, so a controller can be fitted over
a set of prompts (``shim fit --prompts FILE``) and judged on prompts it did not see. A prompt
file is either one prompt per line (blank lines skipped; the line's text without its newline)
or JSON Lines with a ``"prompt"`` field per line (for prompts that span lines, e.g. few-shot
prompts). The manifest records the set's size and sha256 and one sha256 per prompt, so a
loaded controller can say when it meets a prompt outside the set (:func:`fitted_on`); and, in
``training.prompting.prompt_ids_sha256``, one sha256 per prompt of the token ids the LM was
conditioned on (chat template and BOS included), which is all a ``LogitsProcessor`` sees of
its prompt (:class:`FittedPrompts`).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence


def prompt_sha256(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def prompt_ids_sha256(ids: Sequence[int]) -> str:
    """Of a prompt's token ids as the LM is conditioned on them (decimal, comma-separated)."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode("ascii")).hexdigest()


@dataclass(frozen=True)
class PromptSet:
    """Prompts in file order (duplicates kept: a duplicate weighs its prompt twice)."""

    prompts: tuple[str, ...]
    source: str | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"prompt set {self.source or ''} is empty".replace("  ", " "))
        for i, p in enumerate(self.prompts):
            if not isinstance(p, str) or not p.strip():
                raise ValueError(f"prompt {i} of {self.source or 'the set'} is empty or not "
                                 f"text")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def sha256(self) -> str:
        """Of the prompts in order (the JSON list of their texts)."""
        return hashlib.sha256(json.dumps(list(self.prompts), ensure_ascii=False).encode()
                              ).hexdigest()

    def record(self) -> dict[str, Any]:
        """The manifest's ``training.prompt_set``."""
        return {"size": len(self), "sha256": self.sha256, "source": self.source,
                "prompt_sha256": [prompt_sha256(p) for p in self.prompts]}


def read_prompt_set(path: str | Path) -> PromptSet:
    """One prompt per line, or JSON Lines with a ``"prompt"`` string field (chosen by the
    first non-blank line: a JSON object means JSON Lines)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (the file is empty)")
    if not lines[0][1].lstrip().startswith("{"):
        return PromptSet(tuple(line for _, line in lines), str(path))
    prompts = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}, line {n}: not JSON ({exc.msg}); a JSON Lines prompt "
                             f"file has one object with a \"prompt\" field per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}, line {n}: no \"prompt\" string field")
        prompts.append(row["prompt"])
    return PromptSet(tuple(prompts), str(path))


def fitted_on(manifest: Mapping[str, Any], prompt: str) -> bool | None:
    """Whether a controller's manifest says it was fitted on ``prompt`` (one of its set, or its
    one prompt); None when the manifest records no prompt."""
    return FittedPrompts.from_manifest(manifest).has_text(prompt)


@dataclass(frozen=True)
class FittedPrompts:
    """What a manifest says about the prompts its controller was fitted on: their texts'
    sha256 and their token ids' sha256 (either may be unrecorded: None)."""

    size: int
    text_sha256: frozenset[str] | None
    ids_sha256: frozenset[str] | None

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> "FittedPrompts":
        training = manifest.get("training", {}) or {}
        prompt_set = training.get("prompt_set") or {}
        if prompt_set.get("prompt_sha256"):
            texts = frozenset(prompt_set["prompt_sha256"])
        elif manifest.get("prompt") is not None:
            texts = frozenset({prompt_sha256(manifest["prompt"])})
        else:
            texts = None
        ids = (training.get("prompting") or {}).get("prompt_ids_sha256")
        return cls(int(prompt_set.get("size") or 1), texts,
                   frozenset(ids) if ids else None)

    def has_text(self, prompt: str) -> bool | None:
        return None if self.text_sha256 is None else prompt_sha256(prompt) in self.text_sha256

    def has_ids(self, ids: Sequence[int]) -> bool | None:
        return None if self.ids_sha256 is None else prompt_ids_sha256(ids) in self.ids_sha256

    def describe(self) -> str:
        return (f"its {self.size} fitted prompts" if self.size > 1 else
                "the prompt it was fitted on")


class PromptOutsideFitWarning(UserWarning):
    """A controller is used with a prompt it was not fitted on."""


def warn_outside_fit(fitted: FittedPrompts, where: str, what: str, stacklevel: int = 3) -> None:
    """The :class:`PromptOutsideFitWarning` for ``what`` (a prompt, some rows of a batch)."""
    warnings.warn(f"{where}: {what} is not among {fitted.describe()}; the correction is used "
                  f"outside its fit (it usually transfers to prompts of the same task: see "
                  f"docs/prompt_transfer.md; fit on a prompt set with `shim fit --prompts`)",
                  PromptOutsideFitWarning, stacklevel=stacklevel)
