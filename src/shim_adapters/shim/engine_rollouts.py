"""Fit a controller from rollouts that served engines (vLLM) sample: the LM never loads here.

The engine samples masked completions with the SHIM logits processor (``plugins/shim-vllm``)
opted in per request through a *masking artefact*: a controller artefact with β = 0, whose
adjuster is inert, so the processor masks with the artefact's backend and grammar compiled for
the engine's tokenizer and adds nothing. The same backend and grammar compile here, so the
engine's mask is this process's mask (replay checks every token).

Per step the fit needs the LM's log-probability of the sampled token (log p), its log-probability
under the masked proposal that drew it (log q = log p − log Z) and the allowed set with the LM's
log-probabilities. They come back from the engine as:

- log q and the top-k allowed alternatives: the completion's ``logprobs`` on a server started
  with ``--logprobs-mode processed_logprobs`` (the log-softmax of the logits after the logits
  processors, so over the masked distribution; at temperature 1 nothing else changes them);
- log p: ``prompt_logprobs`` of the finished completion sent back as a prompt (prompt
  log-probabilities are the raw LM's: no sampling processors run on a prompt). One extra
  prefill per completion, mostly served from the engine's prefix cache;
- log Z = log p − log q per step, exact whatever k is; the allowed set stored for a row is the
  top-k of the masked distribution (k = ``--top-logprobs``, at most the server's
  ``--max-logprobs``), the rest counts as below ``allowed_min_prob``.

Reporting log Z from inside the processor would need a side channel per request that vLLM's
logits-processor interface does not have; raw and processed log-probabilities of one request
are not both available either (the mode is per server), hence the second request.

The masker states and features are replayed here from the token ids
(:func:`replay_rollouts`), giving the same :class:`~shim_adapters.shim.training_data.TrainingData`
the in-process engine records, and the same fitting steps
(:func:`~shim_adapters.shim.fitting.run_recipe`: target, trust decision, manifest) make the
artefact.

Collection is resumable: every finished rollout is one line of a JSONL file (flushed and
synced as it lands) under a header naming the model, tokenizer, grammar, backend, prompt and
sampling settings; a rerun with the same settings keeps the finished lines and draws only the
missing indices (a torn last line from a killed writer is dropped). Rollout ``i`` is drawn with
seed ``f(seed, i)`` whichever engine serves it, so several engines (data-parallel ranks, hosts)
split the indices between them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shim_adapters.errors import ShimError
from shim_adapters.lm.engine_client import EngineClient, EngineError, ServedModel
from shim_adapters.lm.sampling import Samples
from shim_adapters.mask.protocol import Masker
from shim_adapters.shim.training_data import (
    TrainingData,
    _RowRecorder,
    training_data_from_samples,
)

#: File format of a collection (the header's ``format``).
COLLECTION_FORMAT = "shim-engine-rollouts"
COLLECTION_VERSION = 1
#: Probe texts per engine for the tokenizer check (chunks of the decoded vocabulary).
TOKENIZER_PROBES = 16
#: At or below this a reported log-probability is a masked-out token (vLLM writes -9999).
MASKED_LOGPROB = -9000.0
#: Requests in flight per engine.
DEFAULT_CONCURRENCY = 8


class EngineMismatchError(ShimError):
    """An engine serves another model or tokenizer than the fit was set up for."""


class CollectionMismatchError(ShimError):
    """A collection file on disk was drawn with other settings than the ones asked for now."""


class EngineReplayError(ShimError):
    """A rollout does not replay through this process's masker (the engine masked otherwise)."""


@dataclass(frozen=True)
class EngineRecord:
    """One finished engine rollout, as stored (one JSON line)."""

    index: int
    seed: int
    engine: str
    token_ids: list[int]
    #: log q per step: the masked proposal's log-probability of the sampled token
    proposal_logprobs: list[float]
    #: log p per step: the LM's log-probability of the sampled token
    lm_logprobs: list[float]
    #: per step, the top-k tokens of the masked proposal: token id -> log q
    top: list[dict[int, float]]
    finish_reason: str | None
    seconds: float = 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["top"] = [{str(k): v for k, v in step.items()} for step in self.top]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "EngineRecord":
        d = json.loads(line)
        d["top"] = [{int(k): float(v) for k, v in step.items()} for step in d["top"]]
        return cls(**d)


def rollout_seed(seed: int, index: int) -> int:
    """The engine seed of rollout ``index`` of a draw seeded ``seed`` (independent of which
    engine draws it, so a resumed or re-split collection draws the same rollouts)."""
    digest = hashlib.sha256(f"{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


class RolloutStore:
    """The JSONL file of one draw's finished rollouts, under a header of its settings."""

    def __init__(self, path: str | os.PathLike, header: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.header = {"format": COLLECTION_FORMAT, "version": COLLECTION_VERSION,
                       **json.loads(json.dumps(dict(header)))}
        self._lock = threading.Lock()
        self.records: dict[int, EngineRecord] = {}
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._write_line(json.dumps(self.header, sort_keys=True))
            return
        lines = self.path.read_text().split("\n")
        try:
            found = json.loads(lines[0])
        except ValueError:
            raise CollectionMismatchError(f"{self.path}: the first line is not a collection "
                                          f"header; move the file away to start over") from None
        differ = sorted(k for k in set(found) | set(self.header)
                        if found.get(k) != self.header.get(k))
        if differ:
            raise CollectionMismatchError(
                f"{self.path} was collected with other settings ({', '.join(differ)}: "
                f"{[found.get(k) for k in differ]} there, {[self.header.get(k) for k in differ]}"
                f" now); use another collection directory or the same settings")
        complete = lines[1:-1] if not self.path.read_bytes().endswith(b"\n") else lines[1:]
        for line in complete:
            if line.strip():
                rec = EngineRecord.from_json(line)
                self.records[rec.index] = rec
        if not self.path.read_bytes().endswith(b"\n"):
            # a writer killed mid-line: keep the finished lines, drop the torn one
            with self.path.open("r+b") as fh:
                data = fh.read()
                fh.seek(0)
                fh.truncate()
                fh.write(data[:data.rfind(b"\n") + 1])

    def _write_line(self, line: str) -> None:
        with self.path.open("a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def append(self, record: EngineRecord) -> None:
        with self._lock:
            self._write_line(record.to_json())
            self.records[record.index] = record


@dataclass
class EngineSettings:
    """How the engines sample (everything that must match for a collection to resume)."""

    max_new_tokens: int = 128
    top_logprobs: int = 20
    #: directory of the masking artefact (β = 0) as the engines see it
    masking_artefact: str = ""
    #: extra per-request arguments of the masking artefact (a grammar file, when not built in)
    extra_args: dict[str, Any] = field(default_factory=dict)
    concurrency: int = DEFAULT_CONCURRENCY
    allowed_min_prob: float | None = 1e-8
    allowed_max_stored: int | None = 4096

    def request_args(self) -> dict[str, Any]:
        return {"shim_controller": self.masking_artefact, **self.extra_args}

    def sampling(self) -> dict[str, Any]:
        return {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                "max_new_tokens": int(self.max_new_tokens),
                "top_logprobs": int(self.top_logprobs)}


def served_model(clients: Sequence[EngineClient]) -> ServedModel:
    """The one model every engine serves (same name and path), else EngineMismatchError."""
    served = [c.served_model() for c in clients]
    first = served[0]
    for other in served[1:]:
        if (other.id, other.root) != (first.id, first.root):
            raise EngineMismatchError(f"the engines serve different models: {first.url} "
                                      f"serves {first.id!r} ({first.root}), {other.url} serves "
                                      f"{other.id!r} ({other.root})")
    return first


def tokenizer_probes(tokenizer, prompt: str, n_probes: int = TOKENIZER_PROBES) -> list[str]:
    """Texts whose token ids must agree between this tokenizer and an engine's: the prompt and
    chunks of the decoded vocabulary spread over all ids."""
    size = len(tokenizer)
    chunk = max(1, min(64, size // max(1, n_probes)))
    starts = np.linspace(0, max(0, size - chunk), num=min(n_probes, max(1, size // chunk)),
                         dtype=int)
    texts = [prompt]
    for s in sorted(set(int(x) for x in starts)):
        texts.append(tokenizer.decode(list(range(s, s + chunk)), skip_special_tokens=True))
    return [t for t in texts if t]


def check_engines(clients: Sequence[EngineClient], tokenizer, prompt: str, *,
                  lm_revision: str | None = None,
                  served_revision: Callable[[str], str | None] | None = None) -> ServedModel:
    """Refuse, before any rollout, engines that serve different models, a tokenizer other than
    ``tokenizer`` (token ids of probe texts compared), or (where ``served_revision`` can read
    the served model's weights) weights other than ``lm_revision``."""
    model = served_model(clients)
    probes = tokenizer_probes(tokenizer, prompt)
    for client in clients:
        for text in probes:
            mine = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            theirs = client.tokenize(model.id, text)
            if mine != theirs:
                k = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                         min(len(mine), len(theirs)))
                raise EngineMismatchError(
                    f"{client.url} tokenizes differently from this tokenizer (model "
                    f"{model.id!r}): {text[:40]!r} gives {theirs[k:k + 5]} there and "
                    f"{mine[k:k + 5]} here at token {k}; fit with the served model's tokenizer")
    if lm_revision is not None and served_revision is not None:
        theirs = served_revision(model.root)
        if theirs is not None and theirs != lm_revision:
            raise EngineMismatchError(f"{model.url} serves {model.root!r}, whose weights are not "
                                      f"the LM given here (weights sha256 {theirs[:12]} there, "
                                      f"{lm_revision[:12]} here)")
    return model


def collect_rollouts(clients: Sequence[EngineClient], model: ServedModel, store: RolloutStore,
                     n: int, prompt_ids: Sequence[int], seed: int, settings: EngineSettings,
                     *, progress: bool = True) -> list[EngineRecord]:
    """Draw the rollouts ``0..n-1`` the store does not hold yet, spread over the engines; each
    finished one is appended to the store at once. An engine that fails stops the draw: the
    finished rollouts stay in the store, and the error says how to resume."""
    from tqdm.auto import tqdm

    todo = [i for i in range(n) if i not in store.records]
    prompt_ids = [int(t) for t in prompt_ids]
    stop = threading.Event()

    def draw(i: int) -> None:
        if stop.is_set():
            return
        client = clients[i % len(clients)]
        t0 = time.perf_counter()
        s = rollout_seed(seed, i)
        comp = client.complete(model.id, prompt_ids, max_tokens=settings.max_new_tokens,
                               seed=s, top_logprobs=settings.top_logprobs,
                               extra_args=settings.request_args())
        scored = client.prompt_logprobs(model.id, prompt_ids + comp.token_ids)
        lm = [float(x) for x in scored[len(prompt_ids):]]
        store.append(EngineRecord(index=i, seed=s, engine=client.url, token_ids=comp.token_ids,
                                  proposal_logprobs=comp.logprobs, lm_logprobs=lm,
                                  top=comp.top_logprobs, finish_reason=comp.finish_reason,
                                  seconds=time.perf_counter() - t0))

    errors: list[BaseException] = []
    workers = max(1, settings.concurrency * len(clients))
    with tqdm(total=n, initial=n - len(todo), desc="engine rollouts", unit="seq",
              disable=not progress, leave=False) as bar, \
            ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(draw, i) for i in todo]
        for fut in as_completed(futures):
            try:
                fut.result()
                bar.update(1)
            except BaseException as exc:  # noqa: BLE001 -- reported below, with the count kept
                stop.set()
                errors.append(exc)
    if errors:
        kept = len(store.records)
        raise EngineError(f"engine rollouts stopped after {kept} of {n} ({errors[0]}); the "
                          f"finished ones are kept in {store.path}: rerun the same command to "
                          f"resume") from errors[0]
    return [store.records[i] for i in range(n)]


def replay_rollouts(records: Sequence[EngineRecord], masker: Masker, *, prompt: str,
                    eos: Sequence[int], seed: int, settings: EngineSettings,
                    lm_fields: Mapping[str, str], engine: Mapping[str, Any]) -> TrainingData:
    """Masker states and features replayed from the engine's token ids, as the in-process
    engine records them while sampling (:class:`~shim_adapters.shim.training_data.TrainingData`
    of masked completions). A token this masker forbids raises :class:`EngineReplayError`."""
    t0 = time.perf_counter()
    threshold = (None if settings.allowed_min_prob is None
                 else float(np.log(settings.allowed_min_prob)))
    recorder = _RowRecorder(threshold, settings.allowed_max_stored)
    eos_set = frozenset(int(e) for e in eos)
    width = masker.vocab_size
    for rec in records:
        if not (len(rec.token_ids) == len(rec.lm_logprobs) == len(rec.proposal_logprobs)
                == len(rec.top)):
            raise EngineReplayError(f"rollout {rec.index}: {len(rec.token_ids)} tokens but "
                                    f"{len(rec.lm_logprobs)} / {len(rec.proposal_logprobs)} / "
                                    f"{len(rec.top)} log-probability entries")
    states = [masker.new_state() for _ in records]
    logz: list[list[float]] = [[] for _ in records]
    longest = max((len(r.token_ids) for r in records), default=0)
    # step-major, as the batched in-process engine records its rows
    for step in range(longest):
        for k, rec in enumerate(records):
            if step >= len(rec.token_ids):
                continue
            state, token = states[k], int(rec.token_ids[step])
            mask = state.allowed_mask()
            if not (0 <= token < width and mask[token]):
                raise EngineReplayError(
                    f"rollout {rec.index} (engine {rec.engine}) step {step}: the engine sampled "
                    f"token {token}, which this {masker.fingerprint().get('backend')} masker "
                    f"forbids after {state.describe()}; the engine's masking artefact does not "
                    f"match this grammar/backend/tokenizer")
            lp, lq = float(rec.lm_logprobs[step]), float(rec.proposal_logprobs[step])
            log_z = lp - lq
            logp = np.full(width, -np.inf, dtype=np.float64)
            for tid, q in rec.top[step].items():
                # vLLM reports a masked-out token's log-probability as -9999 (not -inf)
                if 0 <= tid < width and mask[tid] and q > MASKED_LOGPROB:
                    logp[tid] = q + log_z
            logp[token] = lp
            recorder.record(k, step, state, token, logp, mask, log_z)
            logz[k].append(log_z)
            state.advance(token)
    tokens = [list(r.token_ids) for r in records]
    lps = [[float(x) for x in r.lm_logprobs] for r in records]
    lqs = [[float(x) for x in r.proposal_logprobs] for r in records]
    finished = [bool(r.token_ids) and r.token_ids[-1] in eos_set for r in records]
    n = len(records)
    drawn = Samples(token_ids=tokens, finished=finished, lm_logprobs=lps,
                    log_allowed_mass=logz, proposal_logprobs=lqs,
                    seconds=float(sum(r.seconds for r in records)),
                    forward_tokens=int(sum(len(t) for t in tokens)), states=states,
                    cut=[False] * n, failed=[False] * n)
    sampling = {"proposal": "masked", **settings.sampling(), "seed": int(seed),
                "allowed_min_prob": settings.allowed_min_prob,
                "allowed_max_stored": settings.allowed_max_stored,
                "cut_at_first_refusal": False, "engine": dict(engine)}
    data = training_data_from_samples(drawn, recorder, masker, prompt=prompt, eos=eos_set,
                                      sampling=sampling, sample_seconds=drawn.seconds,
                                      lm_fields=dict(lm_fields))
    data.manifest["replay_seconds"] = time.perf_counter() - t0
    return data
