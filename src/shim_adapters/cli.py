"""The ``shim`` command line."""

from __future__ import annotations

import json

import click

from . import __version__
from .protocol import FEATURE_NAMES


@click.group()
@click.version_option(__version__, prog_name="shim")
def main() -> None:
    """SHIM: grammar-constrained decoding that keeps the guarantee and follows the LM."""


@main.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def backends_command(as_json: bool) -> None:
    """List installed masker backends, their versions and the state features each exposes."""
    from .plugins import backends

    found = backends()
    rows = [{"backend": spec.name, "version": spec.version,
             "formats": list(spec.grammar_formats),
             **{name: spec.feature_status[name].value for name in FEATURE_NAMES},
             "description": spec.description} for spec in found.values()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
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
    for r in rows:  # per-format differences in feature status are spelled out here
        if r["description"]:
            click.echo(f"{r['backend']}: {r['description']}")


def _compile(backend: str | None, grammar_spec: str, lm):
    from .demo import _default_backend
    from .grammar import load_grammar
    from .plugins import get_backend

    grammar = load_grammar(grammar_spec)
    return get_backend(backend or _default_backend()).compile(grammar, lm.tokenizer, lm.vocab_size)


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
    from .demo import run_demo

    result = run_demo(grammar=grammar, backend=backend, n_train=n_train, out_dir=out_dir,
                      seed=seed)
    click.echo(result.markdown())
    click.echo("")
    for path in result.files:
        click.echo(f"wrote {path}")


@main.command("fit")
@click.option("--grammar", "grammar_spec", required=True,
              help="Built-in grammar name or a grammar file (.lark, .ebnf, .json, .regex).")
@click.option("--backend", default=None, help="Masker backend (default: syncode if installed).")
@click.option("--lm", "lm_spec", default=None,
              help="'default' (shipped), a local HF model directory, a .gguf file, or 'smollm2'.")
@click.option("--prompt", default=None, help="Prompt text (default: the grammar's built-in prompt).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--kind", type=click.Choice(["LR_NT", "LR_FULL", "MLP"]), default="LR_FULL",
              show_default=True)
@click.option("--n-samples", default=1000, show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for the artefact (safetensors + manifest.json).")
def fit_command(grammar_spec, backend, lm_spec, prompt, prompt_file, kind, n_samples,
                max_new_tokens, seed, out_dir) -> None:
    """Sample the LM, fit a SHIM controller and save it as a checked artefact."""
    from pathlib import Path

    from .controller import fit_controller
    from .lm import load_lm

    lm = load_lm(lm_spec)
    masker = _compile(backend, grammar_spec, lm)
    if prompt_file:
        prompt = Path(prompt_file).read_text()
    _, manifest = fit_controller(lm, masker, prompt, kind=kind, n_samples=n_samples,
                                 max_new_tokens=max_new_tokens, seed=seed, output_dir=out_dir)
    click.echo(json.dumps({k: manifest[k] for k in ("controller_kind", "training")
                           if k in manifest}, indent=2, default=str))
    click.echo(f"wrote {out_dir}")


@main.command("sample")
@click.option("--grammar", "grammar_spec", required=True)
@click.option("--backend", default=None)
@click.option("--lm", "lm_spec", default=None)
@click.option("--controller", "controller_dir", default=None, type=click.Path(exists=True),
              help="Artefact from `shim fit`; omit for plain masking.")
@click.option("--prompt", default=None)
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("-n", "--num-samples", default=5, show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--seed", default=None, type=int)
def sample_command(grammar_spec, backend, lm_spec, controller_dir, prompt, prompt_file,
                   num_samples, max_new_tokens, seed) -> None:
    """Sample constrained outputs, SHIM-corrected when a controller is given."""
    from pathlib import Path

    from .artefact import load_controller
    from .correction import sample_with_shim
    from .lm import load_lm

    lm = load_lm(lm_spec)
    masker = _compile(backend, grammar_spec, lm)
    controller = load_controller(controller_dir, masker, lm)[0] if controller_dir else None
    if prompt_file:
        prompt = Path(prompt_file).read_text()
    prompt = prompt if prompt is not None else masker.grammar.default_prompt
    if prompt is None:
        raise click.UsageError("this grammar has no built-in prompt: pass --prompt or --prompt-file")
    out = sample_with_shim(lm, masker, controller, prompt, num_samples,
                           max_new_tokens=max_new_tokens, seed=seed)
    for text, complete in zip(out.texts, out.complete):
        click.echo(json.dumps({"text": text, "complete": complete}, ensure_ascii=False))


@main.command("eval")
@click.option("--suite", required=True,
              help="fast, binary5, json, sql, bv4, spider, or a suite file (.json/.toml).")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Benchmark data for the bv4/spider suites (e.g. ../shared/benchmarks/BV4).")
@click.option("--lm", "lm_spec", default=None, help="default, a model dir, a .gguf, or smollm2.")
@click.option("--backend", default="xgrammar", show_default=True)
@click.option("--methods", default="masking,lr_nt,lr_full,mlp,asap,rejection", show_default=True,
              help="Comma-separated methods.")
@click.option("--n-samples", default=1000, show_default=True,
              help="Unconstrained LM samples whose valid ones form the KL support.")
@click.option("--n-train", default=None, type=int, help="Controller training samples.")
@click.option("--asap-samples", default=100, show_default=True)
@click.option("--cases", default=None, help="Comma-separated case names to run.")
@click.option("--limit", default=None, type=int, help="Run only the first N cases.")
@click.option("--target", type=click.Choice(["final", "rollout", "bootstrap"]), default="final",
              show_default=True, help="SHIM training labels (see shim_adapters.targets).")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_dir", default="runs/eval", show_default=True,
              type=click.Path(file_okay=False))
def eval_command(suite, data_dir, lm_spec, backend, methods, n_samples, n_train, asap_samples,
                 cases, limit, target, seed, out_dir) -> None:
    """KL to the grammar-conditioned target and time per sample, per method and case."""
    from .evaluation.report import markdown
    from .evaluation.runner import run_eval

    report = run_eval(suite, lm_spec=lm_spec, backend=backend,
                      methods=[m.strip() for m in methods.split(",") if m.strip()],
                      n_samples=n_samples, seed=seed, out_dir=out_dir, n_train=n_train,
                      asap_samples=asap_samples, data_dir=data_dir, limit=limit, target=target,
                      cases=tuple(c.strip() for c in cases.split(",")) if cases else None)
    click.echo(markdown(report))
    click.echo(f"wrote {out_dir}")


@main.command("report")
@click.argument("report_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def report_command(report_dir, no_plots) -> None:
    """Recompute an evaluation's metrics from its stored scores (no sampling) and rewrite
    report.json, report.md and the plots."""
    from .evaluation.rescore import rescore_report

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

    from .conformance.__main__ import main as conformance_main

    sys.exit(conformance_main(list(args)))


if __name__ == "__main__":
    main()
