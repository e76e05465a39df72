"""Encoding masker state + candidate token into sparse controller inputs.

A controller sees, per (state, candidate token) pair, the indices of its active binary
features. They come in three groups, laid out as consecutive column blocks:

``state``  one-hot strings read from :class:`~shim_adapters.mask.protocol.StateFeatures`: the top-k
           recent parser states (``ps0:...``, ``ps1:...``), the lexer (terminal, position) pairs
           and their terminals, the partial lexeme and a bucket of its length, backend extras;
``token``  the candidate token id;
``cross``  state x token interactions: (state feature, token) pairs seen in training. Without
           them a linear model ranks tokens the same in every state (DESIGN.md section 2).

Features a backend declares missing are ``None`` in every state and simply never fire.

Scoring is vectorised over the allowed set: :meth:`FeatureEncoder.encode_state` runs once per
step and yields the state's column indices and its cross keys (64-bit hashes of the crossing
state features); the token and cross columns of all allowed tokens are then one numpy gather
(:meth:`FeatureEncoder.token_columns`) and one ``searchsorted``
(:meth:`FeatureEncoder.cross_columns`). Cross pairs are identified by a 64-bit mix of the
feature hash and the token id, so a vocabulary of observed pairs is exact (no bucket
collisions) and only pairs seen in training carry weight.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import scipy.sparse as sp

from shim_adapters.mask.protocol import StateFeatures, canonical_value, state_key

#: Feature groups an encoder can emit (its ``groups`` hyper-parameter picks a subset).
FEATURE_GROUPS = ("state", "token", "cross")
#: Which state features are crossed with the token by default.
DEFAULT_CROSS_WITH = ("parser_state", "partial_lexeme", "lexer_state")
#: Name of the pair hash, recorded in artefact manifests (change it and old artefacts refuse).
PAIR_HASH = "splitmix64(blake2b64(feature) ^ token*0x9E3779B97F4A7C15)"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def feature_hash(text: str) -> int:
    """Stable 64-bit hash of a feature string (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def pair_hash(keys: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """64-bit hash of (feature key, token) pairs; broadcasts ``keys`` against ``tokens``."""
    with np.errstate(over="ignore"):
        x = np.asarray(keys, dtype=np.uint64) ^ (np.asarray(tokens, dtype=np.uint64) * _GOLDEN)
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        x = x ^ (x >> np.uint64(31))
    return x


def _length_bucket(n: int) -> str:
    for bound, name in ((0, "0"), (1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16")):
        if n <= bound:
            return name
    return "17+"


@dataclass(frozen=True)
class EncodedState:
    """One state's contribution, computed once per decoding step."""

    #: Column indices (into the state block) of the state's known one-hot features.
    state_columns: np.ndarray
    #: 64-bit hashes of the state features that are crossed with the candidate token.
    cross_keys: np.ndarray


class FeatureEncoder:
    """Builds feature vocabularies from training states (``fit``) and encodes pairs.

    Parameters are hyper-parameters in the scikit-learn sense; learned vocabularies end in
    ``_``. ``groups`` picks which blocks are emitted (LR_NT uses ``("token",)``).
    """

    def __init__(self, groups: Sequence[str] = FEATURE_GROUPS, parser_top_k: int = 3,
                 cross_with: Sequence[str] = DEFAULT_CROSS_WITH, min_count: int = 1,
                 min_cross_count: int = 2, use_extra: bool = True):
        self.groups = tuple(groups)
        self.parser_top_k = parser_top_k
        self.cross_with = tuple(cross_with)
        self.min_count = min_count
        self.min_cross_count = min_cross_count
        self.use_extra = use_extra

    # ---- raw feature strings ------------------------------------------------------------
    def state_strings(self, f: StateFeatures) -> list[str]:
        """The one-hot feature strings of a state (absent fields contribute nothing)."""
        out: list[str] = []
        if f.parser_state is not None:
            for i, s in enumerate(f.parser_state[: self.parser_top_k]):
                out.append(f"ps{i}:{s}")
            out.append(f"psdepth:{_length_bucket(len(f.parser_state))}")
        if f.lexer_state is not None:
            terminals = set()
            for terminal, position in sorted(f.lexer_state):
                out.append(f"lx:{terminal}:{position}")
                terminals.add(terminal)
            out.extend(f"lxt:{t}" for t in sorted(terminals))
            out.append(f"lxn:{_length_bucket(len(f.lexer_state))}")
        if f.partial_lexeme is not None:
            out.append(f"pl:{f.partial_lexeme}")
            out.append(f"plen:{_length_bucket(len(f.partial_lexeme))}")
        if self.use_extra and f.extra:
            out.extend(f"x:{k}:{canonical_value(v)}"
                       for k, v in sorted(f.extra.items(), key=lambda kv: str(kv[0])))
        return out

    def cross_strings(self, f: StateFeatures) -> list[str]:
        """The state features crossed with the candidate token."""
        if "cross" not in self.groups:
            return []
        out: list[str] = []
        if "parser_state" in self.cross_with and f.parser_state:
            out.append(f"ps0:{f.parser_state[0]}")
        if "partial_lexeme" in self.cross_with and f.partial_lexeme is not None:
            out.append(f"pl:{f.partial_lexeme}")
        if "lexer_state" in self.cross_with and f.lexer_state is not None:
            out.append("lxset:" + "|".join(f"{t}@{p}" for t, p in sorted(f.lexer_state)))
        return out

    # ---- fit ------------------------------------------------------------------------------
    def fit(self, states: Sequence[StateFeatures], row_state: np.ndarray,
            row_token: np.ndarray) -> "FeatureEncoder":
        """Vocabularies from training rows: row i is (states[row_state[i]], row_token[i])."""
        unknown = set(self.groups) - set(FEATURE_GROUPS)
        if unknown or not self.groups:
            raise ValueError(f"groups must be a non-empty subset of {FEATURE_GROUPS}, "
                             f"got {self.groups}")
        row_state = np.asarray(row_state, dtype=np.int64)
        row_token = np.asarray(row_token, dtype=np.int64)
        state_rows = np.bincount(row_state, minlength=len(states))
        counts: Counter[str] = Counter()
        if "state" in self.groups:
            for sid, n in enumerate(state_rows):
                if n:
                    for s in self.state_strings(states[sid]):
                        counts[s] += int(n)
        self.state_vocab_ = sorted(s for s, n in counts.items() if n >= self.min_count)
        token_counts = Counter(row_token.tolist()) if "token" in self.groups or \
            "cross" in self.groups else Counter()
        self.token_vocab_ = np.array(sorted(t for t, n in token_counts.items()
                                            if n >= self.min_count), dtype=np.int64)
        if "token" not in self.groups:
            self.token_vocab_ = np.zeros(0, dtype=np.int64)
        if "cross" in self.groups:
            if "token" not in self.groups:
                raise ValueError("the cross group needs the token group (crosses are only "
                                 "scored for tokens with a column of their own)")
            known = set(self.token_vocab_.tolist())
            keys_per_state = [np.array([feature_hash(s) for s in self.cross_strings(f)],
                                       dtype=np.uint64) for f in states]
            pairs = [pair_hash(keys_per_state[s], t) for s, t in zip(row_state.tolist(),
                                                                      row_token.tolist())
                     if t in known]
            allp = np.concatenate(pairs) if pairs else np.zeros(0, dtype=np.uint64)
            uniq, n = np.unique(allp, return_counts=True)
            self.cross_vocab_ = uniq[n >= self.min_cross_count]
        else:
            self.cross_vocab_ = np.zeros(0, dtype=np.uint64)
        self._index_vocab()
        return self

    def _index_vocab(self) -> None:
        self._state_index = {s: i for i, s in enumerate(self.state_vocab_)}
        self._token_index = {int(t): i for i, t in enumerate(self.token_vocab_)}
        self._token_dense: np.ndarray | None = None
        self._cache: dict[tuple, EncodedState] = {}

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def n_state_(self) -> int:
        return len(self.state_vocab_)

    @property
    def n_token_(self) -> int:
        return len(self.token_vocab_)

    @property
    def n_cross_(self) -> int:
        return len(self.cross_vocab_)

    @property
    def n_features_(self) -> int:
        return self.n_state_ + self.n_token_ + self.n_cross_

    # ---- encoding -------------------------------------------------------------------------
    def encode_state(self, features: StateFeatures) -> EncodedState:
        """The state part of every pair at this step (cached: states recur across steps)."""
        key = state_key(features)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        cols = [self._state_index[s] for s in self.state_strings(features)
                if s in self._state_index] if "state" in self.groups else []
        keys = [feature_hash(s) for s in self.cross_strings(features)]
        enc = EncodedState(np.array(sorted(set(cols)), dtype=np.int64),
                           np.array(keys, dtype=np.uint64))
        if len(self._cache) < 100_000:
            self._cache[key] = enc
        return enc

    def token_columns(self, token_ids: np.ndarray) -> np.ndarray:
        """Column (within the token block) of each token; -1 for tokens unseen in training."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        dense = self._token_dense
        if dense is None:
            # one slot past the largest known token: every larger id maps there (-1)
            dense = np.full(int(self.token_vocab_.max(initial=-1)) + 2, -1, dtype=np.int64)
            dense[self.token_vocab_] = np.arange(self.n_token_)
            self._token_dense = dense
        return dense[np.minimum(token_ids, len(dense) - 1)]

    def cross_columns(self, cross_keys: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """(n_keys, n_tokens) columns (within the cross block) of each pair; -1 if unseen."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if self.n_cross_ == 0 or len(cross_keys) == 0:
            return np.full((len(cross_keys), len(token_ids)), -1, dtype=np.int64)
        h = pair_hash(np.asarray(cross_keys, dtype=np.uint64)[:, None], token_ids[None, :])
        pos = np.searchsorted(self.cross_vocab_, h)
        pos_c = np.minimum(pos, self.n_cross_ - 1)
        return np.where(self.cross_vocab_[pos_c] == h, pos_c, -1)

    def transform(self, states: Sequence[StateFeatures], row_state: np.ndarray,
                  row_token: np.ndarray) -> sp.csr_matrix:
        """Sparse binary design matrix, one row per (states[row_state[i]], row_token[i])."""
        return self.transform_encoded([self.encode_state(f) for f in states], row_state,
                                      row_token)

    def transform_encoded(self, encoded: Sequence[EncodedState], row_state: np.ndarray,
                          row_token: np.ndarray) -> sp.csr_matrix:
        row_state = np.asarray(row_state, dtype=np.int64)
        row_token = np.asarray(row_token, dtype=np.int64)
        n = len(row_state)
        blocks_r, blocks_c = [], []
        # state block: concatenate each state's columns, then expand per row
        lengths = np.array([len(e.state_columns) for e in encoded], dtype=np.int64)
        if lengths.sum():
            flat = np.concatenate([e.state_columns for e in encoded])
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            row_len = lengths[row_state]
            r = np.repeat(np.arange(n), row_len)
            within = np.arange(row_len.sum()) - np.repeat(np.cumsum(row_len) - row_len, row_len)
            blocks_r.append(r)
            blocks_c.append(flat[np.repeat(starts[row_state], row_len) + within])
        if self.n_token_:
            tc = self.token_columns(row_token)
            ok = tc >= 0
            blocks_r.append(np.flatnonzero(ok))
            blocks_c.append(self.n_state_ + tc[ok])
        if self.n_cross_:
            for sid in np.unique(row_state):
                rows = np.flatnonzero(row_state == sid)
                cc = self.cross_columns(encoded[sid].cross_keys, row_token[rows])
                k, m = np.nonzero(cc >= 0)
                blocks_r.append(rows[m])
                blocks_c.append(self.n_state_ + self.n_token_ + cc[k, m])
        r = np.concatenate(blocks_r) if blocks_r else np.zeros(0, dtype=np.int64)
        c = np.concatenate(blocks_c) if blocks_c else np.zeros(0, dtype=np.int64)
        data = np.ones(len(r), dtype=np.float64)
        mat = sp.csr_matrix((data, (r, c)), shape=(n, self.n_features_))
        mat.sum_duplicates()
        mat.data[:] = 1.0
        return mat

    # ---- persistence ----------------------------------------------------------------------
    def get_params(self) -> dict:
        return dict(groups=list(self.groups), parser_top_k=self.parser_top_k,
                    cross_with=list(self.cross_with), min_count=self.min_count,
                    min_cross_count=self.min_cross_count, use_extra=self.use_extra)

    def vocab_manifest(self) -> dict:
        """JSON-able vocabularies (the cross vocabulary is a tensor: see :meth:`tensors`)."""
        return {"params": self.get_params(), "state_vocab": list(self.state_vocab_),
                "token_vocab": [int(t) for t in self.token_vocab_],
                "n_cross": int(self.n_cross_), "pair_hash": PAIR_HASH}

    def tensors(self) -> dict[str, np.ndarray]:
        return {"encoder.cross_vocab": self.cross_vocab_.astype(np.uint64)}

    @classmethod
    def from_manifest(cls, manifest: Mapping, tensors: Mapping[str, np.ndarray]
                      ) -> "FeatureEncoder":
        if manifest.get("pair_hash") != PAIR_HASH:
            raise ValueError(f"encoder uses pair hash {manifest.get('pair_hash')!r}; this version "
                             f"computes {PAIR_HASH!r}")
        p = manifest["params"]
        enc = cls(groups=p["groups"], parser_top_k=p["parser_top_k"], cross_with=p["cross_with"],
                  min_count=p["min_count"], min_cross_count=p["min_cross_count"],
                  use_extra=p["use_extra"])
        enc.state_vocab_ = list(manifest["state_vocab"])
        enc.token_vocab_ = np.array(manifest["token_vocab"], dtype=np.int64)
        enc.cross_vocab_ = np.asarray(tensors["encoder.cross_vocab"], dtype=np.uint64)
        if len(enc.cross_vocab_) != manifest["n_cross"]:
            raise ValueError(f"cross vocabulary has {len(enc.cross_vocab_)} entries, manifest "
                             f"says {manifest['n_cross']}")
        enc._index_vocab()
        return enc

