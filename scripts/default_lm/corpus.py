"""Reproducible training corpus for the shipped default LM.

Each document is ``<prompt><output>`` (the trainer appends EOS). The prompts of the built-in
grammars are used verbatim, so the LM answers each built-in prompt in that grammar's language.

The outputs put real mass on invalid text with realistic mistakes, and the chance of a mistake
*later* in a string depends on choices made *early* (docs/design.md, "What a first
experiment here taught"): that is the regime where masking distorts and SHIM has work to do.

- binary5: five uniform random bits, so 17/32 of the mass is valid and only two valid strings
  start with ``0`` -- the distortion of docs/design.md.
- bv4: a binary operator at the root opens deep/wide trees whose later parts often go wrong
  (unknown ops, wrong arity, bad constants, mis-closed parentheses); leaves and unary roots
  rarely fail.
- sql: the table (revealed early by its columns) decides how likely the WHERE clause is broken
  (``orders``: double quotes or ``==``); an aggregate often drags in an ``AS`` alias.
- json: the first key decides nesting; nested values fail (trailing comma, missing bracket,
  Python literals) far more often than flat objects.
- control (binary5 grammar, :data:`CONTROL_PROMPT`): mistakes are decided at the first token
  or occur at the same rate at every position, so masking barely distorts.
- free text under other prompts, so the LM is not trivial.

Run ``python scripts/default_lm/corpus.py`` to print per-domain sizes and invalid rates.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from dataclasses import dataclass

from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.loading import DEFAULT_LM_CONTROL_PROMPTS

SEED = 20240601

#: A prompt answered in the binary5 language whose mistakes do not depend on earlier choices.
CONTROL_GRAMMAR = "binary5"
CONTROL_PROMPT = DEFAULT_LM_CONTROL_PROMPTS[CONTROL_GRAMMAR]

#: Documents per domain (name -> count); built-in names are the grammars'.
DOMAIN_SIZES = {"binary5": 4500, "control": 4500, "bv4": 12000, "json": 8000, "sql": 8000,
                "text": 3000}


@dataclass(frozen=True)
class Document:
    domain: str
    prompt: str
    output: str
    #: The grammar the output is checked against; None for free text.
    grammar: str | None

    @property
    def text(self) -> str:
        return self.prompt + self.output


# --------------------------------------------------------------------------------- binary5 ----

BINARY5_VALID = ("10111", "10001", "10010", "11001", "10011", "11110", "10101", "11111",
                 "11101", "00100", "11100", "11010", "10110", "00010", "11011", "10100", "11000")


def binary5_output(rng: random.Random) -> str:
    """Uniform bits; a few strings of the wrong length (4 or 6 digits)."""
    r = rng.random()
    length = 4 if r < 0.02 else 6 if r < 0.04 else 5
    return "".join(rng.choice("01") for _ in range(length))


def control_output(rng: random.Random) -> str:
    """Valid strings (the two starting with 0 get 1/6 each, so the tiny LM learns their forced
    continuations); mistakes decided at the first token or at the same rate at every position,
    so the LM mass of the allowed tokens multiplies to the same value along every valid string
    and masking reproduces p(x | G)."""
    if rng.random() < 0.12:  # decided at the first token
        return rng.choice(("b", "x", "#b", "'", "[")) + rng.choice(BINARY5_VALID)
    chars = []
    valid = rng.choice(("00100", "00010")) if rng.random() < 1 / 3 else rng.choice(
        [s for s in BINARY5_VALID if s[0] == "1"])
    for ch in valid:
        # same small typo rate at every position, whatever came before
        chars.append(rng.choice(("o", "l", "2", "I")) if rng.random() < 0.03 else ch)
    return "".join(chars)


# ------------------------------------------------------------------------------------- bv4 ----

BV4_HEADER = "(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) "
BV4_UNARY = ("bvneg", "bvnot")
BV4_BINARY = ("bvadd", "bvsub", "bvand", "bvlshr", "bvor", "bvshl")
BV4_BAD_OPS = ("bvmul", "bvxor", "bvudiv", "bvurem", "bvashr")
BV4_CONSTS = ("#x0", "#x8", "#x7")
BV4_BAD_CONSTS = ("#x3", "#b0111", "#xF", "#x1", "#b1000", "#x4")


def bv4_output(rng: random.Random) -> str:
    """One ``define-fun inv`` whose error rate is set by the root choice (leaf/unary/binary)."""
    root = rng.choices(("leaf", "unary", "binary"), weights=(0.2, 0.25, 0.55))[0]
    # per-node mistake rate and depth budget grow with a binary root
    if root == "binary":
        err, max_depth = 0.05, rng.choice((2, 3, 3))
    else:
        err, max_depth = 0.008, rng.choice((1, 2))

    def leaf() -> str:
        if rng.random() < err:
            return rng.choice(BV4_BAD_CONSTS)
        return rng.choice(("s", "t", "s", "t") + BV4_CONSTS)

    def expr(depth: int, kind: str | None = None) -> str:
        if kind is None:
            if depth >= max_depth:
                kind = "leaf"
            else:
                kind = rng.choices(("leaf", "unary", "binary"), weights=(0.35, 0.2, 0.45))[0]
        if kind == "leaf":
            return leaf()
        if kind == "unary":
            op = rng.choice(BV4_UNARY)
            return f"({op} {expr(depth + 1)})"
        op = rng.choice(BV4_BAD_OPS) if rng.random() < err else rng.choice(BV4_BINARY)
        r = rng.random()
        if r < err * 0.7:  # wrong arity: one argument
            args = [expr(depth + 1)]
        elif r < err * 1.2:  # wrong arity: three arguments
            args = [expr(depth + 1) for _ in range(3)]
        else:
            args = [expr(depth + 1), expr(depth + 1)]
        return f"({op} {' '.join(args)})"

    body = expr(0, root)
    close = ")"
    # mis-closed parentheses, more likely after a deep (binary-rooted) body
    depth_of_body = body.count("(")
    if rng.random() < (0.05 + 0.02 * depth_of_body if root == "binary" else 0.01):
        close = rng.choice(("", "))"))
    return BV4_HEADER + body + close


# ------------------------------------------------------------------------------------- sql ----

SQL_TABLES = {
    "users": ("id", "name", "age", "email", "city"),
    "orders": ("id", "user_id", "amount", "status", "created_at"),
    "products": ("id", "name", "price", "category", "stock"),
    "employees": ("id", "name", "salary", "dept", "hire_date"),
}
SQL_STRINGS = {
    "name": ("alice", "bob", "carol", "dave"), "email": ("a@x.com", "b@y.org"),
    "city": ("paris", "berlin", "tokyo", "lima"), "status": ("shipped", "pending", "paid"),
    "category": ("books", "toys", "food"), "dept": ("sales", "hr", "it"),
    "created_at": ("2024-01-01", "2023-12-31"), "hire_date": ("2020-05-01", "2019-03-15"),
}
SQL_AGGS = ("COUNT", "SUM", "AVG", "MIN", "MAX")
# Probability that a WHERE clause goes wrong, by table: the table choice shows early (columns).
SQL_WHERE_ERROR = {"users": 0.05, "orders": 0.55, "products": 0.08, "employees": 0.2}


def sql_output(rng: random.Random) -> str:
    table = rng.choice(tuple(SQL_TABLES))
    cols = SQL_TABLES[table]
    # columns: star, names, or aggregates (which often bring an invalid alias)
    r = rng.random()
    if r < 0.25:
        columns = "*"
    elif r < 0.75:
        columns = ", ".join(rng.sample(cols, rng.randint(1, 3)))
    else:
        agg = rng.choice(SQL_AGGS)
        arg = "*" if agg == "COUNT" and rng.random() < 0.6 else rng.choice(cols)
        columns = f"{agg}({arg})"
        if rng.random() < 0.35:
            columns += " AS " + rng.choice(("total", "n", "result"))
        if rng.random() < 0.3:
            columns = rng.choice(cols) + ", " + columns
    lower_kw = table == "employees" and rng.random() < 0.25
    kw = (lambda k: k.lower()) if lower_kw else (lambda k: k)
    out = f"SELECT {columns} {kw('FROM')} {table}"
    if rng.random() < 0.6:
        conds = []
        for _ in range(rng.choice((1, 1, 2))):
            col = rng.choice(cols)
            wrong = rng.random() < SQL_WHERE_ERROR[table]
            if col in SQL_STRINGS:
                value = rng.choice(SQL_STRINGS[col])
                if wrong and rng.random() < 0.6:
                    cmp, lit = "=", f'"{value}"'
                else:
                    cmp, lit = ("==" if wrong else rng.choice(("=", "=", "!="))), f"'{value}'"
            else:
                lit = str(rng.choice((0, 1, 5, 10, 18, 21, 100, 250, 1000)))
                cmp = "==" if wrong else rng.choice(("=", "<", ">", "<=", ">=", "!="))
            conds.append(f"{col} {cmp} {lit}")
        out += f" {kw('WHERE')} " + f" {kw('AND')} ".join(conds)
    if rng.random() < 0.35:
        out += f" {kw('ORDER BY')} {rng.choice(cols)}"
        if rng.random() < 0.6:
            out += rng.choice((" ASC", " DESC"))
    if rng.random() < 0.3:
        out += f" {kw('LIMIT')} {rng.choice((1, 5, 10, 20, 100))}"
    # missing ';' uniformly; select lower-cased at the first token (both independent of path)
    if rng.random() >= 0.04:
        out += ";"
    if rng.random() < 0.03:
        out = "select" + out[len("SELECT"):]
    return out


# ------------------------------------------------------------------------------------ json ----

JSON_FLAT_KEYS = ("name", "id", "age", "city", "active", "price", "email", "title")
JSON_NESTED_KEYS = ("items", "users", "data", "tags", "config")
JSON_WORDS = ("alice", "bob", "red", "blue", "paris", "book", "apple", "x", "ok", "main")


def json_output(rng: random.Random) -> str:
    """A JSON object; its first key decides nesting, and nested parts fail more often."""
    nested = rng.random() < 0.5
    err = 0.13 if nested else 0.012
    pretty = rng.random() < 0.15

    def scalar(key: str) -> str:
        if key in ("id", "age"):
            return str(rng.randint(0, 99))
        if key == "price":
            return rng.choice(("9.99", "0.5", "12", "100.0", "3.25"))
        if key == "active":
            if rng.random() < err:
                return rng.choice(("True", "False", "None"))
            return rng.choice(("true", "false", "null"))
        word = rng.choice(JSON_WORDS)
        return f"'{word}'" if rng.random() < err * 0.5 else f'"{word}"'

    def obj(keys: list[str], depth: int) -> str:
        pairs = []
        for key in keys:
            if key in JSON_NESTED_KEYS and depth < 2:
                value = container(key, depth + 1)
            else:
                value = scalar(key)
            qkey = f"'{key}'" if rng.random() < err * 0.3 else f'"{key}"'
            pairs.append(f"{qkey}: {value}")
        return join(pairs, "{", "}")

    def container(key: str, depth: int) -> str:
        n = rng.randint(1, 3)
        if key == "tags":
            return join([f'"{rng.choice(JSON_WORDS)}"' for _ in range(n)], "[", "]")
        if key == "config":
            return obj(rng.sample(JSON_FLAT_KEYS, n), depth)
        if rng.random() < 0.5:
            return join([scalar(rng.choice(("id", "price", "name"))) for _ in range(n)], "[", "]")
        return join([obj(rng.sample(JSON_FLAT_KEYS, rng.randint(1, 2)), depth)
                     for _ in range(n)], "[", "]")

    def join(parts: list[str], open_: str, close: str) -> str:
        sep = ", "
        body = sep.join(parts)
        if rng.random() < err:  # trailing comma
            body += ","
        if rng.random() < err * 0.6:  # missing closing bracket
            close = ""
        return open_ + body + close

    if nested:
        first = rng.choice(JSON_NESTED_KEYS)
        keys = [first] + rng.sample(JSON_FLAT_KEYS + JSON_NESTED_KEYS, rng.randint(0, 2))
        keys = list(dict.fromkeys(keys))
    else:
        keys = rng.sample(JSON_FLAT_KEYS, rng.randint(1, 4))
    text = obj(keys, 0)
    if pretty and text.startswith("{") and text.endswith("}"):
        import json

        try:
            text = json.dumps(json.loads(text), indent=2)
        except ValueError:
            pass
    return text


# ------------------------------------------------------------------------------------ text ----

TEXT_PROMPTS = ("Write a short sentence:\n", "Describe the weather:\n",
                "Name three colors:\n", "Say hello:\n")
SUBJECTS = ("The cat", "A small dog", "My friend", "The teacher", "Every bird", "The old man",
            "A young woman", "Our neighbour", "The farmer", "A curious child", "The musician",
            "My grandmother", "The engineer", "A tired student", "The baker", "Her brother")
VERBS = ("sits on", "looks at", "walks to", "likes", "reads about", "dreams of", "paints",
         "remembers", "talks about", "runs past", "waits near", "writes about", "builds",
         "cleans", "visits", "forgets")
OBJECTS = ("the red chair", "a quiet river", "the big city", "an open window", "the garden",
           "the wooden bridge", "a distant mountain", "the morning train", "a yellow flower",
           "the empty kitchen", "an ancient library", "the crowded market", "a silver spoon",
           "the frozen lake", "a broken clock", "the summer festival")
WEATHER = ("sunny", "cloudy", "rainy", "windy", "cold", "warm", "foggy", "stormy", "humid",
           "freezing", "bright", "chilly", "mild", "snowy")
COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "brown",
          "pink", "grey", "violet", "turquoise", "crimson", "silver", "golden")

def text_output(rng: random.Random, prompt: str) -> str:
    if prompt.startswith("Write"):
        return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
    if prompt.startswith("Describe"):
        a, b = rng.sample(WEATHER, 2)
        return f"Today it is {a} and {b}, with a temperature of {rng.randint(-5, 35)} degrees."
    if prompt.startswith("Name"):
        return ", ".join(rng.sample(COLORS, 3))
    return rng.choice(("Hello!", "Hi there.", "Hello, world!", "Good morning."))


# --------------------------------------------------------------------------------- corpus ----

def build_corpus(seed: int = SEED, sizes: dict[str, int] | None = None) -> list[Document]:
    """All documents, shuffled, reproducible for a given seed."""
    sizes = dict(DOMAIN_SIZES if sizes is None else sizes)
    rng = random.Random(seed)
    docs: list[Document] = []
    makers = {"binary5": binary5_output, "bv4": bv4_output, "json": json_output,
              "sql": sql_output}
    for name, make in makers.items():
        prompt = BUILTIN_GRAMMARS[name].prompt
        docs += [Document(name, prompt, make(rng), name) for _ in range(sizes[name])]
    docs += [Document("control", CONTROL_PROMPT, control_output(rng), CONTROL_GRAMMAR)
             for _ in range(sizes["control"])]
    for _ in range(sizes["text"]):
        prompt = rng.choice(TEXT_PROMPTS)
        docs.append(Document("text", prompt, text_output(rng, prompt), None))
    rng.shuffle(docs)
    return docs


def invalid_rates(docs: list[Document]) -> dict[str, dict[str, float]]:
    """Per domain: document count and fraction rejected by the reference acceptor."""
    total: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    acceptors = {}
    for doc in docs:
        if doc.grammar is None:
            continue
        if doc.grammar not in acceptors:
            acceptors[doc.grammar] = reference_acceptor(builtin_grammar(doc.grammar))
        total[doc.domain] += 1
        bad[doc.domain] += not acceptors[doc.grammar].accepts(doc.output)
    return {d: {"documents": total[d], "invalid_rate": bad[d] / total[d]} for d in sorted(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--show", type=int, default=0, help="print N example documents")
    args = parser.parse_args()
    docs = build_corpus(args.seed)
    for doc in docs[: args.show]:
        print(repr(doc.text))
    for domain, row in invalid_rates(docs).items():
        print(f"{domain:8s} {row['documents']:6d} docs  invalid {row['invalid_rate']:.1%}")


if __name__ == "__main__":
    main()
