"""Differential check: several backends, one grammar and tokenizer, masks compared per step.

Walks follow tokens every backend allows (valid strings under their canonical tokenization,
then random walks over the intersection). At each step every token one backend allows and
another refuses is adjudicated by the full reference (for a JSON schema, the schema itself in
its two readings, :mod:`.schema_reference`): an extension that certainly starts a valid string
means the refusing backends are incomplete there; a non-viable one means the allowing backends
are unsound; anything else is undecided, never an alarm.
Each disagreement is kept at its shortest prefix (its first step along any walk).
"""

from __future__ import annotations

import random
import time
from typing import Sequence

import numpy as np

from shim_adapters.conformance.checks import CellContext
from shim_adapters.conformance.generate import valid_strings
from shim_adapters.conformance.report import DifferentialResult
from shim_adapters.conformance.tokenizations import excused_split
from shim_adapters.mask.protocol import Masker, Tokenizations


def differential(contexts: Sequence[CellContext]) -> DifferentialResult:
    """Compare the maskers of ``contexts`` (same grammar and tokenizer, different backends)."""
    t0 = time.perf_counter()
    ref = contexts[0]
    p = ref.profile
    names = [c.masker.backend_name for c in contexts]
    result = DifferentialResult(tokenizer=ref.tokenizer_name, grammar=ref.grammar.name,
                                backends=names,
                                verdicts={n: {"unsound": 0, "incomplete": 0, "undecided": 0}
                                          for n in names})
    widths = {c.masker.vocab_size for c in contexts}
    if len(widths) != 1:
        result.notes.append(f"maskers disagree on the logits width {sorted(widths)}")
        return result
    rng = random.Random(p.seed + 7)
    strings, _ = valid_strings(ref.grammar, max(1, p.differential_walks // 2), p.seed + 1)
    seeds: list[list[int] | None] = [ref.vocab.canonical(s)[0] for _, s in strings]
    seeds += [None] * (p.differential_walks - len(seeds))
    best: dict[tuple, dict] = {}
    for planned in seeds:
        if time.perf_counter() - t0 > p.safety_cap_s:
            result.notes.append(f"incomplete: stopped by the wall-clock safety cap "
                                f"({p.safety_cap_s:.0f} s) after {result.walks} of "
                                f"{len(seeds)} walks")
            break
        result.walks += 1
        _walk(contexts, planned, rng, result, best)
    result.repros = sorted(best.values(), key=lambda r: (r["verdict"], len(r["prefix_text"])))
    result.repros = result.repros[:p.keep_failures]
    result.seconds = round(time.perf_counter() - t0, 3)
    return result


def _walk(contexts, planned, rng, result: DifferentialResult, best: dict) -> None:
    ref = contexts[0]
    p = ref.profile
    states = [c.masker.new_state() for c in contexts]
    ids: list[int] = []
    for step in range(len(planned) if planned is not None else 2 * p.walk_budget):
        masks = np.stack([s.allowed_mask() for s in states]) & ref.is_text
        eos = [s.eos_allowed() for s in states]
        result.steps += 1
        result.tokens_compared += int(masks.any(axis=0).sum())
        differ = np.flatnonzero(masks.any(axis=0) & ~masks.all(axis=0))
        data = ref.data(ids)
        if len(differ):
            result.disagreements += len(differ)
            pick = differ if len(differ) <= p.differential_tokens_per_step else \
                rng.sample(list(differ), p.differential_tokens_per_step)
            for t in pick:
                verdict = _adjudicate(ref, data + (ref.vocab.token_bytes[int(t)] or b""))
                declared = _refused_as_declared(contexts, masks, int(t), data) if verdict \
                    else set()
                _record(contexts, masks[:, t], int(t), verdict, ids, result, best, declared)
        if len(set(eos)) > 1:
            result.disagreements += 1
            _record(contexts, np.array(eos), None, ref.accepts(ids), ids, result, best)
        common = np.flatnonzero(masks.all(axis=0))
        if planned is not None:
            t = planned[step]
            if not masks[:, t].all():
                return  # a backend refuses the valid string here: recorded above
        else:
            if all(eos) and (not len(common) or step >= p.walk_budget or rng.random() < 0.2):
                return
            if not len(common):
                return
            t = int(common[rng.randrange(len(common))])
        for s in states:
            s.advance(int(t))
        ids.append(int(t))


def _adjudicate(ref: CellContext, data: bytes) -> bool | None:
    """False: certainly not viable (the allowing backends are unsound); True: certainly the
    start of a valid string (the refusing ones are incomplete); None: the references cannot
    tell (for a JSON schema, viable only in some member order or spelling)."""
    if ref.viable(data) is False:
        return False
    return ref.viable_for_refusal(data)


def _refused_as_declared(contexts, masks: np.ndarray, token: int, data: bytes) -> set[str]:
    """Backends refusing ``token`` as their tokenizations declaration says they may (a
    split of forced text, another split allowed): not incomplete."""
    out = set()
    for c, row in zip(contexts, masks):
        if not row[token] and c.tokenizations is Tokenizations.CANONICAL_IN_FORCED_TEXT \
                and excused_split(c, c.forced, data, token, row):
            out.add(c.masker.backend_name)
    return out


def _record(contexts, allowed_by: np.ndarray, token: int | None, verdict: bool | None,
            ids: list[int], result: DifferentialResult, best: dict,
            declared: set[str] = frozenset()) -> None:
    ref = contexts[0]
    names = [c.masker.backend_name for c in contexts]
    yes = [n for n, a in zip(names, allowed_by) if a]
    no = [n for n, a in zip(names, allowed_by) if not a]
    label = "undecided" if verdict is None else "viable" if verdict else "not viable"
    if verdict is None:
        for n in names:
            result.verdicts[n]["undecided"] += 1
    elif verdict:
        for n in no:
            key = "refused_as_declared" if n in declared else "incomplete"
            result.verdicts[n][key] = result.verdicts[n].get(key, 0) + 1
        no = [n for n in no if n not in declared]
        if not no:
            return
    else:
        for n in yes:
            result.verdicts[n]["unsound"] += 1
    key = (token, tuple(yes), label)
    prefix_text = ref.text(ids)
    if key in best and len(best[key]["prefix_text"]) <= len(prefix_text):
        return
    best[key] = {
        "token": "EOS" if token is None else f"{token} {ref.vocab.text_of(token)!r}",
        "token_id": token, "prefix_text": prefix_text, "prefix_token_ids": list(ids),
        "allowed_by": yes, "refused_by": no,
        "verdict": ("accepting" if verdict else "not accepting") if token is None else label,
    }


def masker_groups(maskers: Sequence[Masker]) -> list[list[Masker]]:
    """Maskers grouped by (grammar, tokenizer identity)."""
    groups: dict[tuple, list[Masker]] = {}
    for m in maskers:
        groups.setdefault((m.grammar.sha256, m.tokenizer_identity.sha256), []).append(m)
    return [g for g in groups.values() if len(g) > 1]
