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


if __name__ == "__main__":
    main()
