"""Command-line entry point: parses arguments and calls into the parts. Nothing else."""

from __future__ import annotations

import json
import sys

import click

from mtpkit import __version__
from mtpkit.verify import doctor as doctor_mod

EXAMPLES_DOCTOR = """
\b
Examples:
  mtpkit doctor ./Qwen3.6-35B-A3B-mlx-4bit
  mtpkit doctor mlx-community/Qwen3.5-27B-4bit --json     # repo id in the local HF cache
  mtpkit doctor ./bundle --deep                           # also scan tensor data for NaN/Inf
\b
Exit codes: 0 no errors, 1 error findings, 2 not a model folder / bad usage.
"""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mtpkit")
def main() -> None:
    """Convert, diagnose, repair and verify MLX bundles for MTP speculative decoding."""


@main.command(epilog=EXAMPLES_DOCTOR)
@click.argument("bundle")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (doctor_report "
              "schema) instead of the table.")
@click.option("--deep", is_flag=True, help="Stream all tensor data (bounded memory): NaN/Inf, "
              "all-zero scales, empty sidecar, manifest sha256.")
def doctor(bundle: str, as_json: bool, deep: bool) -> None:
    """Diagnose BUNDLE (a folder or a cached repo id) without loading its weights."""
    bar = None

    def on_open(view) -> None:
        nonlocal bar
        from mtpkit.verify.deep import deep_bytes

        bar = click.progressbar(length=deep_bytes(view), label="deep scan", file=sys.stderr,
                                show_eta=True, width=30)
        bar.__enter__()

    try:
        doc = doctor_mod.report(bundle, deep=deep, on_open=on_open if deep else None,
                                progress=lambda n: bar.update(n) if bar else None)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(doctor_mod.render_text(doc))
    sys.exit(doc["summary"]["exit_code"])


if __name__ == "__main__":
    main()
