"""Encoding masker state + candidate token into sparse controller inputs.

A controller sees, per (state, candidate token) pair, the indices of its active binary
features. They come in three groups, laid out as consecutive column blocks:

``state``  one-hot strings read from :class:`~shim_adapters.mask.protocol.StateFeatures`: the top-k
           recent parser states (``ps0:...``, ``ps1:...``), the lexer (terminal, position) pairs
           and their terminals, the partial lexeme and a bucket of its length, backend extras;
``token``  the candidate token id;
``cross``  state x token interactions: (state feature, token) pairs seen in training. Without
           them a linear model ranks tokens the same in every state (docs/design.md).

Optional text features (``text_ngrams=N > 0``) see the token's text, not only its id: hashed
byte n-grams (n = 1..N, the text framed by start and end marks) of each known token's text
(``text``), the same n-grams crossed with the state's cross features (``text_cross``: what kind
of text fits this lexer / parser state), and the n-grams of the partial lexeme as state
features. Tokens sharing text share weight: an identifier seen once borrows from the
identifiers around it. Only tokens with a column of their own carry text features (their texts
are recorded in the manifest), so every other allowed token keeps the one shared value; the
static ``text`` part folds into each token's row at scoring time.

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
#: How text n-grams are hashed (recorded with text features; a different scheme refuses).
TEXT_HASH = "blake2b64('tg:' + hex(n-gram of b'\\x02' + utf8(text) + b'\\x03'))"

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


def text_ngrams(text: str, n_max: int) -> list[bytes]:
    """Distinct byte n-grams (n = 1..n_max) of ``text`` framed by start/end marks, in order."""
    b = b"\x02" + text.encode("utf-8", "surrogatepass") + b"\x03"
    seen: dict[bytes, None] = {}
    for n in range(1, n_max + 1):
        for i in range(len(b) - n + 1):
            seen.setdefault(b[i:i + n], None)
    return list(seen)


def ngram_hashes(text: str, n_max: int) -> np.ndarray:
    """64-bit hashes of :func:`text_ngrams` (sorted, distinct)."""
    return np.unique(np.array([feature_hash("tg:" + g.hex()) for g in text_ngrams(text, n_max)],
                              dtype=np.uint64))


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
                 min_cross_count: int = 2, use_extra: bool = True, text_ngrams: int = 0):
        self.groups = tuple(groups)
        self.parser_top_k = parser_top_k
        self.cross_with = tuple(cross_with)
        self.min_count = min_count
        self.min_cross_count = min_cross_count
        self.use_extra = use_extra
        #: Longest byte n-gram of the text features; 0: no text features (module docstring).
        self.text_ngrams = int(text_ngrams)

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
            if self.text_ngrams:
                out.extend(f"plg:{g.hex()}" for g in text_ngrams(f.partial_lexeme,
                                                                 self.text_ngrams))
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
            row_token: np.ndarray, token_texts: Mapping[int, str] | None = None
            ) -> "FeatureEncoder":
        """Vocabularies from training rows: row i is (states[row_state[i]], row_token[i]).
        ``token_texts`` (token id -> text) is needed with text features."""
        unknown = set(self.groups) - set(FEATURE_GROUPS)
        if unknown or not self.groups:
            raise ValueError(f"groups must be a non-empty subset of {FEATURE_GROUPS}, "
                             f"got {self.groups}")
        if self.text_ngrams and "token" not in self.groups:
            raise ValueError("text features need the token group (they belong to tokens with "
                             "a column of their own)")
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
        self.token_text_: dict[int, str] = {}
        self.text_vocab_ = np.zeros(0, dtype=np.uint64)
        self.text_cross_vocab_ = np.zeros(0, dtype=np.uint64)
        if self.text_ngrams:
            self._fit_text(states, row_state, row_token, token_texts)
        self._index_vocab()
        return self

    def _fit_text(self, states, row_state: np.ndarray, row_token: np.ndarray,
                  token_texts: Mapping[int, str] | None) -> None:
        known = self.token_vocab_.tolist()
        missing = [t for t in known if token_texts is None or t not in token_texts]
        if missing:
            raise ValueError(f"text features need the text of every known token; missing for "
                             f"{len(missing)} token(s), e.g. {missing[:3]}")
        self.token_text_ = {int(t): str(token_texts[t]) for t in known}
        grams = {t: ngram_hashes(self.token_text_[t], self.text_ngrams) for t in known}
        col = {t: i for i, t in enumerate(known)}
        rows_of_token = np.bincount([col[t] for t in row_token.tolist() if t in col],
                                    minlength=len(known))
        counts: Counter[int] = Counter()
        for t, n in zip(known, rows_of_token.tolist()):
            for g in grams[t].tolist():
                counts[g] += n
        self.text_vocab_ = np.array(sorted(g for g, n in counts.items()
                                           if n >= self.min_cross_count), dtype=np.uint64)
        if "cross" in self.groups:
            keys_per_state = [np.array([feature_hash(s) for s in self.cross_strings(f)],
                                       dtype=np.uint64) for f in states]
            pairs = [pair_hash(keys_per_state[s][:, None], grams[t][None, :]).ravel()
                     for s, t in zip(row_state.tolist(), row_token.tolist()) if t in col]
            allp = np.concatenate(pairs) if pairs else np.zeros(0, dtype=np.uint64)
            uniq, n = np.unique(allp, return_counts=True)
            self.text_cross_vocab_ = uniq[n >= self.min_cross_count]

    def _index_vocab(self) -> None:
        self._state_index = {s: i for i, s in enumerate(self.state_vocab_)}
        self._token_index = {int(t): i for i, t in enumerate(self.token_vocab_)}
        self._token_dense: np.ndarray | None = None
        self._cache: dict[tuple, EncodedState] = {}
        #: Per token column: its n-gram hashes (text features only).
        self._token_grams: list[np.ndarray] = []
        #: (n_token, n_text) 0/1: the text columns of each token column.
        self.token_text_matrix_ = sp.csr_matrix((self.n_token_, self.n_text_))
        if self.text_ngrams and self.n_token_:
            self._token_grams = [ngram_hashes(self.token_text_[int(t)], self.text_ngrams)
                                 for t in self.token_vocab_]
            r, c = [], []
            for i, g in enumerate(self._token_grams):
                cols = _lookup(self.text_vocab_, g)
                cols = cols[cols >= 0]
                r.append(np.full(len(cols), i, dtype=np.int64))
                c.append(cols)
            r_all, c_all = np.concatenate(r), np.concatenate(c)
            self.token_text_matrix_ = sp.csr_matrix(
                (np.ones(len(r_all)), (r_all, c_all)), shape=(self.n_token_, self.n_text_))

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
    def n_text_(self) -> int:
        return len(getattr(self, "text_vocab_", ()))

    @property
    def n_text_cross_(self) -> int:
        return len(getattr(self, "text_cross_vocab_", ()))

    @property
    def n_features_(self) -> int:
        return self.n_state_ + self.n_token_ + self.n_cross_ + self.n_text_ + self.n_text_cross_

    def text_cross_columns(self, cross_key: int, token_columns: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        """The (crossing key, n-gram) pairs of the given token columns: (index into
        ``token_columns``, column within the text-cross block) of each pair seen in training."""
        if not self.n_text_cross_ or not len(token_columns):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        grams = [self._token_grams[c] for c in token_columns.tolist()]
        owner = np.repeat(np.arange(len(grams)), [len(g) for g in grams])
        h = pair_hash(np.uint64(cross_key), np.concatenate(grams))
        cols = _lookup(self.text_cross_vocab_, h)
        ok = cols >= 0
        return owner[ok], cols[ok]

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
        if self.n_text_:
            tc = self.token_columns(row_token)
            known = np.flatnonzero(tc >= 0)
            sub = self.token_text_matrix_[tc[known]].tocoo()
            blocks_r.append(known[sub.row])
            blocks_c.append(self.n_state_ + self.n_token_ + self.n_cross_ + sub.col)
        if self.n_text_cross_:
            base = self.n_state_ + self.n_token_ + self.n_cross_ + self.n_text_
            tc = self.token_columns(row_token)
            for sid in np.unique(row_state):
                rows = np.flatnonzero((row_state == sid) & (tc >= 0))
                for key in encoded[sid].cross_keys.tolist():
                    owner, cols = self.text_cross_columns(key, tc[rows])
                    blocks_r.append(rows[owner])
                    blocks_c.append(base + cols)
        r = np.concatenate(blocks_r) if blocks_r else np.zeros(0, dtype=np.int64)
        c = np.concatenate(blocks_c) if blocks_c else np.zeros(0, dtype=np.int64)
        data = np.ones(len(r), dtype=np.float64)
        mat = sp.csr_matrix((data, (r, c)), shape=(n, self.n_features_))
        mat.sum_duplicates()
        mat.data[:] = 1.0
        return mat

    # ---- persistence ----------------------------------------------------------------------
    def get_params(self) -> dict:
        params = dict(groups=list(self.groups), parser_top_k=self.parser_top_k,
                      cross_with=list(self.cross_with), min_count=self.min_count,
                      min_cross_count=self.min_cross_count, use_extra=self.use_extra)
        if self.text_ngrams:  # absent at 0, so encoders without text read as they always did
            params["text_ngrams"] = self.text_ngrams
        return params

    def vocab_manifest(self) -> dict:
        """JSON-able vocabularies (the cross vocabularies are tensors: see :meth:`tensors`)."""
        out = {"params": self.get_params(), "state_vocab": list(self.state_vocab_),
               "token_vocab": [int(t) for t in self.token_vocab_],
               "n_cross": int(self.n_cross_), "pair_hash": PAIR_HASH}
        if self.text_ngrams:
            out["text"] = {"hash": TEXT_HASH, "n_text": int(self.n_text_),
                           "n_text_cross": int(self.n_text_cross_),
                           "token_text": [self.token_text_[int(t)] for t in self.token_vocab_]}
        return out

    @property
    def uses_text(self) -> bool:
        """Text features in use: an artefact then needs a reader that knows them."""
        return bool(self.text_ngrams)

    def tensors(self) -> dict[str, np.ndarray]:
        out = {"encoder.cross_vocab": self.cross_vocab_.astype(np.uint64)}
        if self.text_ngrams:
            out["encoder.text_vocab"] = self.text_vocab_.astype(np.uint64)
            out["encoder.text_cross_vocab"] = self.text_cross_vocab_.astype(np.uint64)
        return out

    @classmethod
    def from_manifest(cls, manifest: Mapping, tensors: Mapping[str, np.ndarray]
                      ) -> "FeatureEncoder":
        if manifest.get("pair_hash") != PAIR_HASH:
            raise ValueError(f"encoder uses pair hash {manifest.get('pair_hash')!r}; this version "
                             f"computes {PAIR_HASH!r}")
        p = manifest["params"]
        enc = cls(groups=p["groups"], parser_top_k=p["parser_top_k"], cross_with=p["cross_with"],
                  min_count=p["min_count"], min_cross_count=p["min_cross_count"],
                  use_extra=p["use_extra"], text_ngrams=p.get("text_ngrams", 0))
        enc.state_vocab_ = list(manifest["state_vocab"])
        enc.token_vocab_ = np.array(manifest["token_vocab"], dtype=np.int64)
        enc.cross_vocab_ = np.asarray(tensors["encoder.cross_vocab"], dtype=np.uint64)
        if len(enc.cross_vocab_) != manifest["n_cross"]:
            raise ValueError(f"cross vocabulary has {len(enc.cross_vocab_)} entries, manifest "
                             f"says {manifest['n_cross']}")
        enc.token_text_ = {}
        enc.text_vocab_ = np.zeros(0, dtype=np.uint64)
        enc.text_cross_vocab_ = np.zeros(0, dtype=np.uint64)
        if enc.text_ngrams:
            text = manifest.get("text") or {}
            if text.get("hash") != TEXT_HASH:
                raise ValueError(f"encoder hashes text n-grams as {text.get('hash')!r}; this "
                                 f"version computes {TEXT_HASH!r}")
            if len(text.get("token_text", ())) != len(enc.token_vocab_):
                raise ValueError("text features: the manifest has no text for every known "
                                 "token")
            enc.token_text_ = {int(t): s for t, s in zip(enc.token_vocab_, text["token_text"])}
            enc.text_vocab_ = np.asarray(tensors["encoder.text_vocab"], dtype=np.uint64)
            enc.text_cross_vocab_ = np.asarray(tensors["encoder.text_cross_vocab"],
                                               dtype=np.uint64)
            if (len(enc.text_vocab_), len(enc.text_cross_vocab_)) != (text["n_text"],
                                                                      text["n_text_cross"]):
                raise ValueError("text vocabularies do not match the manifest's sizes")
        enc._index_vocab()
        return enc


def _lookup(vocab: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Position of each key in the sorted ``vocab``; -1 where absent."""
    if not len(vocab):
        return np.full(len(keys), -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(vocab, keys), len(vocab) - 1)
    return np.where(vocab[pos] == keys, pos, -1).astype(np.int64)

