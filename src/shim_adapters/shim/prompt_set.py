"""A prompt set: the prompts one controller of a grammar is fitted on.

A served grammar meets a different prompt on every request, so a controller can be fitted over
a set of prompts (``shim fit --prompts FILE``) and judged on prompts it did not see. A prompt
file is either one prompt per line (blank lines skipped; the line's text without its newline)
or JSON Lines with a ``"prompt"`` field per line (for prompts that span lines, e.g. few-shot
prompts). The manifest records the set's size and sha256 and one sha256 per prompt, so a
loaded controller can say when it meets a prompt outside the set (:func:`fitted_on`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


def prompt_sha256(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


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
    prompt_set = manifest.get("training", {}).get("prompt_set")
    if prompt_set and prompt_set.get("prompt_sha256"):
        return prompt_sha256(prompt) in set(prompt_set["prompt_sha256"])
    fitted = manifest.get("prompt")
    if fitted is None:
        return None
    return fitted == prompt
