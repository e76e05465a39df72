"""Errors raised by shim-adapters.

Every error names what went wrong and where: the grammar line, the token, the decoding step, and
the masker state that led there (``MaskerState.describe()``), so a failure can be reproduced.
"""

from __future__ import annotations


class ShimError(Exception):
    """Base class of every error this package raises on purpose."""


class GrammarError(ShimError):
    """A grammar could not be read or compiled; carries the line (1-based) when known."""

    def __init__(self, message: str, *, grammar_name: str = "<grammar>", line: int | None = None,
                 column: int | None = None):
        where = grammar_name
        if line is not None:
            where += f", line {line}"
            if column is not None:
                where += f", column {column}"
        super().__init__(f"{where}: {message}")
        self.grammar_name = grammar_name
        self.line = line
        self.column = column


class UnsupportedGrammarError(GrammarError):
    """A grammar uses a construct a backend or converter cannot handle faithfully."""


class ForbiddenTokenError(ShimError):
    """``advance`` was given a token the mask forbids at this state."""

    def __init__(self, token_id: int, token_text: str, step: int, state: str):
        super().__init__(
            f"token {token_id} ({token_text!r}) is not allowed at step {step}; state: {state}")
        self.token_id = token_id
        self.token_text = token_text
        self.step = step
        self.state = state


class DeadEndError(ShimError):
    """No token (and no EOS) is allowed before the grammar accepts: generation fails closed."""

    def __init__(self, step: int, state: str, row: int | None = None):
        where = f"step {step}" + (f", batch row {row}" if row is not None else "")
        super().__init__(f"dead end at {where}: no token is allowed and the grammar does not "
                         f"accept here; refusing to continue unconstrained. State: {state}")
        self.step = step
        self.state = state
        self.row = row


class VocabMismatchError(ShimError):
    """Tokenizer, masker and model disagree on the vocabulary."""


class ManifestMismatchError(ShimError):
    """A stored artefact does not match the grammar, tokenizer, backend or LM in use."""

    def __init__(self, field: str, expected: object, found: object, path: str = "<artefact>"):
        super().__init__(f"{path}: manifest field {field!r} is {found!r} but the run uses "
                         f"{expected!r}; refusing to load a controller fitted for something else")
        self.field = field
        self.expected = expected
        self.found = found


class BackendNotFoundError(ShimError):
    """No installed plugin provides the requested backend."""
