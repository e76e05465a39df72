"""A client for an LM served by vLLM's OpenAI-compatible HTTP server (standard library only).

What an engine fit needs from a server, and the endpoints that give it:

- ``GET /v1/models``: the served model's name (``id``), its path or hub name (``root``) and
  context length (``max_model_len``);
- ``POST /tokenize``: the server's token ids of a text (the tokenizer check);
- ``POST /v1/completions`` with the prompt as token ids, ``logprobs`` and
  ``return_tokens_as_token_ids``: a sampled completion with, per step, the sampled token's
  log-probability and the top-k alternatives, as token ids; with ``prompt_logprobs`` the
  log-probability of every prompt token (how the raw LM log-probabilities of a finished
  completion are read back: see :mod:`shim_adapters.shim.engine_rollouts`).

Every failure raises :class:`EngineError` naming the server and the request; a server that
cannot be reached raises :class:`EngineUnavailableError`.
"""

from __future__ import annotations

import json
import math
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from shim_adapters.errors import ShimError

#: How vLLM spells a token when ``return_tokens_as_token_ids`` is set.
TOKEN_ID_PREFIX = "token_id:"


class EngineError(ShimError):
    """A served engine answered with an error, or with something this client cannot read."""


class EngineUnavailableError(EngineError):
    """A served engine could not be reached (refused, reset, timed out)."""


@dataclass(frozen=True)
class ServedModel:
    """What ``/v1/models`` says about the one model a server serves."""

    url: str
    id: str
    root: str
    max_model_len: int | None


@dataclass(frozen=True)
class Completion:
    """One sampled completion: per step, the token, its log-probability as the server reports
    it, and the top-k alternatives (token id -> log-probability) of that step."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None


class EngineClient:
    """One server, by its base URL (``http://127.0.0.1:8000``; a trailing ``/v1`` is dropped)."""

    def __init__(self, url: str, *, timeout: float = 300.0) -> None:
        url = url.rstrip("/")
        self.url = url[:-3] if url.endswith("/v1") else url
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    # ---- HTTP -----------------------------------------------------------------------------
    def _request(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise EngineError(f"{self.url}{path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EngineUnavailableError(f"{self.url}{path}: the engine cannot be reached "
                                         f"({reason})") from None
        try:
            return json.loads(payload)
        except ValueError:
            raise EngineError(f"{self.url}{path}: the answer is not JSON: "
                              f"{payload[:200]!r}") from None

    # ---- endpoints ------------------------------------------------------------------------
    def served_model(self) -> ServedModel:
        """The model this server serves (a server serving several is refused: name one)."""
        answer = self._request("/v1/models")
        models = answer.get("data", []) if isinstance(answer, dict) else []
        if len(models) != 1:
            names = [m.get("id") for m in models]
            raise EngineError(f"{self.url}/v1/models lists {len(models)} models {names}; an "
                              f"engine fit needs a server that serves exactly one")
        m = models[0]
        return ServedModel(url=self.url, id=str(m.get("id")),
                           root=str(m.get("root") or m.get("id")),
                           max_model_len=m.get("max_model_len"))

    def tokenize(self, model: str, text: str) -> list[int]:
        """The server's token ids of ``text``, without special tokens."""
        answer = self._request("/tokenize", {"model": model, "prompt": text,
                                             "add_special_tokens": False})
        try:
            return [int(t) for t in answer["tokens"]]
        except (KeyError, TypeError, ValueError):
            raise EngineError(f"{self.url}/tokenize: no token ids in {str(answer)[:200]}") from None

    def complete(self, model: str, prompt_ids: Sequence[int], *, max_tokens: int, seed: int,
                 top_logprobs: int, extra_args: Mapping[str, Any] | None = None) -> Completion:
        """Sample one completion at temperature 1, top-p 1, no top-k, from ``seed``."""
        body: dict[str, Any] = {
            "model": model, "prompt": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": int(seed), "n": 1,
            "logprobs": int(top_logprobs), "return_tokens_as_token_ids": True,
            "skip_special_tokens": False}
        if extra_args:
            body["vllm_xargs"] = dict(extra_args)
        answer = self._request("/v1/completions", body)
        try:
            choice = answer["choices"][0]
            lp = choice["logprobs"]
            tokens = [_token_id(t) for t in lp["tokens"]]
            logprobs = [_float(x) for x in lp["token_logprobs"]]
            tops = [{_token_id(k): _float(v) for k, v in (step or {}).items()}
                    for step in lp.get("top_logprobs") or [{}] * len(tokens)]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.url}/v1/completions: cannot read the completion's "
                              f"log-probabilities ({exc!r}) in {str(answer)[:300]}") from None
        return Completion(tokens, logprobs, tops, choice.get("finish_reason"))

    def prompt_logprobs(self, model: str, token_ids: Sequence[int]) -> list[float | None]:
        """log p(token | the tokens before it) for every token of ``token_ids`` as the server
        scores a prompt (the first token, which has no context, gets None)."""
        body = {"model": model, "prompt": [int(t) for t in token_ids], "max_tokens": 1,
                "temperature": 1.0, "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
        answer = self._request("/v1/completions", body)
        try:
            steps = answer["choices"][0]["prompt_logprobs"]
            out: list[float | None] = []
            for token, step in zip(token_ids, steps):
                if step is None:
                    out.append(None)
                    continue
                entry = step.get(str(int(token)))
                if entry is None:
                    entry = step.get(f"{TOKEN_ID_PREFIX}{int(token)}")
                out.append(_float(entry["logprob"] if isinstance(entry, dict) else entry))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.url}/v1/completions: cannot read prompt_logprobs "
                              f"({exc!r}) in {str(answer)[:300]}") from None
        if len(out) != len(token_ids):
            raise EngineError(f"{self.url}: prompt_logprobs has {len(out)} entries for "
                              f"{len(token_ids)} tokens")
        return out


def _token_id(token: str) -> int:
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        return int(token[len(TOKEN_ID_PREFIX):])
    raise ValueError(f"token {token!r} is not spelled as {TOKEN_ID_PREFIX}N "
                     f"(return_tokens_as_token_ids)")


def _float(value) -> float:
    return -math.inf if value is None else float(value)
