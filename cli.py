"""Command-line entry point: parses arguments and calls into the parts. Nothing else."""

from __future__ import annotations

import functools
import json
import shlex
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from mtpkit import __version__
from mtpkit.convert.sidecar import POLICIES, SidecarOptions
from mtpkit.convert.trunk import MODES, RECIPES, QuantOptions, parse_override
from mtpkit.decoder.options import DTYPES as DTYPE_NAMES
from mtpkit.decoder.options import KV_START, SOURCES
from mtpkit.verify import doctor as doctor_mod

EXAMPLES_CONVERT = """
\b
Examples:
  mtpkit convert ./Qwen3.5-27B ./Qwen3.5-27B-mtp-4bit -q
  mtpkit convert Qwen/Qwen3.6-35B-A3B ./q36-4bit -q --mtp-policy layers --mtp-bits 8
  mtpkit convert ./bundle-4bit ./bundle-6bit -q --q-bits 6 --force      # requantize
  mtpkit convert ./src ./out -q --quant-recipe mixed_3_6 --quant-override "*.lm_head=8:64"
  mtpkit convert ./src ./out -q --upload-repo me/Model-MTP-4bit --dry-run
\b
Exit codes: 0 written, 2 bad input or usage (nothing is written).
"""

EXAMPLES_DOCTOR = """
\b
Examples:
  mtpkit doctor ./Qwen3.6-35B-A3B-mlx-4bit
  mtpkit doctor mlx-community/Qwen3.5-27B-4bit --json     # repo id in the local HF cache
  mtpkit doctor ./bundle --deep                           # also scan tensor data for NaN/Inf
  mtpkit doctor ./bundle --fix --out ./bundle-fixed       # repaired copy, then diagnose it
  mtpkit doctor ./bundle --fix --out ./fixed --template-from ./original-checkpoint
\b
Exit codes: 0 no errors, 1 error findings, 2 not a model folder / bad usage.
"""


EXAMPLES_GENERATE = """
\b
Examples:
  mtpkit generate ./bundle "Explain speculative decoding in one paragraph."
  mtpkit generate ./bundle "def fibonacci(n):" --raw --depth 3 --max-tokens 128
  mtpkit generate ./bundle "def parse(self, text):" --raw --compare     # depth auto vs plain
  mtpkit generate ./bundle "Hi" --temperature 0.7 --top-p 0.9 --seed 1 --json
  mtpkit generate ./bundle @long.txt --raw --kv-bits 4    # 4-bit KV cache past 5000 positions
\b
Statistics (acceptance per draft position, the depths auto chose, decode tok/s, TTFT) go to
stderr. Exit codes: 0 generated, 2 bad input or usage.
"""

EXAMPLES_TUNE = """
\b
Examples:
  mtpkit tune ./bundle                       # measured once, then read from the cache
  mtpkit tune ./bundle --refresh --json      # measure again (e.g. after a driver update)
  mtpkit tune ./bundle --dtype float32       # the curve generate/serve --dtype float32 use
\b
The cache lives in $MTPKIT_CACHE (default ~/.cache/mtpkit)/costs, one file per weights,
load options, backend and versions. A measurement aims at 15 s ($MTPKIT_COST_BUDGET) and shows
its progress on stderr. Exit codes: 0 printed, 2 bad input or usage.
"""


EXAMPLES_GRAFT = """
\b
Examples:
  mtpkit graft ./SmolLM2-135M-mlx --out ./SmolLM2-135M-mtp            # 27 minutes, stdlib text
  mtpkit graft ./bundle --out ./bundle-mtp --steps 400 --corpus ./docs --corpus ./src
  mtpkit graft ./bundle --out ./bundle-mtp --minutes 10 --mtp-policy layers --mtp-bits 8
\b
The BLAS in use, the budget's plan and progress (step, loss, ETA) go to stderr.
Exit codes: 0 written, 2 bad input or usage.
"""


def _depth(value: str) -> str | int | None:
    """--depth as typed, checked as every entry checks a depth (decoder/options.py)."""
    from mtpkit.decoder.options import OptionError, depth_option

    try:
        return depth_option(int(value) if value.lstrip("-").isdigit() else value)
    except OptionError as exc:
        _fail(exc.code, exc.say("--depth"), exc.hint)
        return None


def _max_batch(value: int) -> int:
    """--max-batch, checked as every entry checks it (decoder/options.py)."""
    from mtpkit.decoder.options import OptionError, batch_option

    try:
        return batch_option(value)
    except OptionError as exc:
        _fail(exc.code, exc.say("--max-batch"), exc.hint)
        return 1


def _whole(value: str | None) -> int | str | None:
    """An integer option as typed; anything else goes on to decoder/options.py, which refuses
    it with options.invalid like every other entry."""
    return int(value) if value is not None and value.lstrip("-").isdigit() else value


def _kv_options(command: Callable[..., None]) -> Callable[..., None]:
    """--kv-bits, --kv-group-size, --quantized-kv-start: mlx-lm's quantized KV cache, checked
    by load (decoder/options.py kv_option, then whether this trunk's caches can take it)."""
    for option in reversed((
            click.option("--kv-bits", callback=lambda c, p, v: _whole(v), metavar="BITS",
                         help="Quantize the trunk's KV cache to 2, 3, 4, 5, 6 or 8 bits "
                         "(mlx-lm's QuantizedKVCache; the MTP head's stays float). Default: "
                         "not quantized."),
            click.option("--kv-group-size", default="64", show_default=True, metavar="N",
                         callback=lambda c, p, v: _whole(v), help="Group size of the "
                         "quantized KV cache: 32, 64 or 128."),
            click.option("--quantized-kv-start", default=str(KV_START), show_default=True,
                         metavar="N", callback=lambda c, p, v: _whole(v), help="With --kv-bits: "
                         "positions from N on are attended to quantized (the cache switches "
                         "once it holds N positions, as in mlx-lm)."))):
        command = option(command)
    return command


def _kv(kv_bits: int | None, kv_group_size: int, quantized_kv_start: int) -> dict[str, Any]:
    """The three as load's keywords."""
    return {"kv_bits": kv_bits, "kv_group_size": kv_group_size,
            "quantized_kv_start": quantized_kv_start}


DRAFT_MODEL_HELP = ("A separate draft model (mlx-lm's --draft-model): any bundle with this "
                    "one's tokenizer and plain attention caches; it then drafts by default "
                    "(--draft model), 3 drafts a round unless --depth N.")


DRAFT_HELP = ("Draft source: the MTP head, the context (tokens that followed an earlier match; "
              "any bundle), both, or the --draft-model. Default: the draft model where one is "
              "given, else both with --depth auto, the head at a forced depth, lookup for a "
              "bundle without a head.")
DRAFT_CHOICE = click.Choice(SOURCES)


DTYPES = click.Choice(DTYPE_NAMES)
DTYPE_HELP = ("auto: the bundle's own float dtype, or float32 where that is clearly faster (MLX's "
              "CPU backend) and fits; said on stderr. float32 also keeps greedy output identical "
              "to plain decoding at near-ties.")
KEEP_QUANTIZED_HELP = ("Run a quantized bundle's quantized matmuls as mlx-lm does (on MLX's CPU "
                      "backend they run dequantized by default: faster, but greedy text can "
                      "differ from mlx-lm's on the same bundle).")
PROMPT_HELP = ("Refuse a prompt of more than N tokens (error prompt.too_long; serve: a 400, before "
               "any model work). Default: the model's context from config.json "
               "(max_position_embeddings or its family's name for it; no bound where it "
               "declares none); N replaces it.")


SHARD_HELP = ("Under mlx.launch: split the trunk over the ranks, tensor (each rank a share of "
              "every layer's heads) or pipeline (each rank a run of layers); rank 0 drafts, "
              "decides and prints, the others follow.")


def _leads(command: Callable[..., None]) -> Callable[..., None]:
    """A command that may run sharded: its followers exit with its exit code, a lost rank is
    one line (decoder/sharded/distributed.py)."""
    @functools.wraps(command)
    def run(*args: object, **kwargs: object) -> None:
        if kwargs.get("shard") is None:
            return command(*args, **kwargs)
        from mtpkit.decoder.sharded.distributed import leading

        with leading():
            command(*args, **kwargs)

    return run


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
@click.option("--fix", is_flag=True, help="Write a repaired copy to --out and diagnose the copy.")
@click.option("--out", "out", type=click.Path(path_type=Path), help="Where --fix writes.")
@click.option("--template-from", type=click.Path(exists=True, path_type=Path),
              help="Chat template source for --fix: a checkpoint folder, tokenizer_config.json, "
              ".jinja or .gguf file.")
@click.option("--force", is_flag=True, help="With --fix: replace --out if it exists.")
def doctor(bundle: str, as_json: bool, deep: bool, fix: bool, out: Path | None,
           template_from: Path | None, force: bool) -> None:
    """Diagnose BUNDLE (a folder or a cached repo id) without loading its weights."""
    repaired = None
    if fix:
        if out is None:
            _fail("usage", "--fix needs --out DIR (the source is never modified)",
                  "mtpkit doctor BUNDLE --fix --out FIXED")
        repaired = _repair(bundle, out, template_from, force)
        bundle = str(out)
    elif out or template_from:
        _fail("usage", "--out and --template-from go with --fix", "add --fix")
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
    if repaired is not None:
        doc = {**doc, "repair": repaired}
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(doctor_mod.render_text(doc))
    sys.exit(doc["summary"]["exit_code"])


def _fail(code: str, message: str, hint: str) -> None:
    click.echo(f"error [{code}]: {message}\n  hint: {hint}", err=True)
    sys.exit(2)


def _as_command(ctx: click.Context) -> str:
    """The command line as parsed (for the model card): arguments, then non-default options."""
    parts = ["mtpkit", ctx.info_name or "convert"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if isinstance(param, click.Argument):
            parts.append(str(value))
            continue
        if value in (None, False, ()) or value == param.default:
            continue
        flag = max(param.opts, key=len)
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            parts += [flag] if v is True else [flag, str(v)]
    return shlex.join(parts)


@contextmanager
def _user_errors(out_flag: str) -> Iterator[None]:
    """Turn bad-input exceptions into one-line errors with their code and a hint (exit 2)."""
    from mtpkit.convert.writer import OutputExists
    from mtpkit.decoder.options import OptionError
    from mtpkit.loaders.findings import UserError
    from mtpkit.loaders.source import NotABundle
    from mtpkit.loaders.template_sources import TemplateSourceError

    try:
        yield
    except OptionError as exc:  # a decoding option, named as this command spells it
        _fail(exc.code, exc.say("--" + exc.option.replace("_", "-")), exc.hint)
    except NotABundle as exc:
        _fail("files.missing_config", str(exc), exc.hint)
    except OutputExists as exc:
        _fail("output.exists", str(exc), f"choose another {out_flag} or pass --force")
    except UserError as exc:
        _fail(exc.code, str(exc), exc.hint)
    except TemplateSourceError as exc:
        _fail("template.missing", str(exc), "point --template-from at a file or folder with one")


def _repair(bundle: str, out: Path, template_from: Path | None, force: bool) -> dict:
    from mtpkit.convert.repair import repair

    with _user_errors("--out"):
        result = repair(bundle, out, template_from=template_from, force=force)
    return {"source": bundle, "out": str(result.out), "applied": result.applied,
            "template_provenance": result.template_provenance}


@main.command(epilog=EXAMPLES_CONVERT)
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("-q", "--quantize", is_flag=True, help="Quantize the trunk (mlx-lm's meaning).")
@click.option("--q-bits", type=click.IntRange(2, 8), help="Trunk bits (default: 4 for affine).")
@click.option("--q-group-size", type=click.Choice(["16", "32", "64", "128"]), help="Trunk group size.")
@click.option("--q-mode", type=click.Choice(MODES), default="affine", show_default=True)
@click.option("--quant-recipe", type=click.Choice(RECIPES), help="mlx-lm mixed-bit recipe.")
@click.option("--quant-override", "overrides", multiple=True, metavar="PATTERN=BITS[:GROUP]",
              help="Per-module override by fnmatch pattern; PATTERN=float keeps it unquantized. "
              "Repeatable; first match wins.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Float dtype of unquantized tensors (default: the source's torch_dtype).")
@click.option("--mtp-policy", type=click.Choice(POLICIES),
              help="Sidecar quantization: keep (full precision), layers (decoder layer only), "
              "all. Default: layers when -q, else keep.")
@click.option("--mtp-bits", type=click.IntRange(2, 8), default=4, show_default=True)
@click.option("--mtp-group-size", type=click.Choice(["32", "64", "128"]), default="64",
              show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--upload-repo", metavar="ORG/NAME", help="Publish OUT with huggingface_hub.")
@click.option("--dry-run", is_flag=True, help="With --upload-repo: print the upload plan only.")
@click.option("--drafter", metavar="DRAFTER", help="A drafter that ships apart (a folder or "
              "cached repo id): Gemma 4's assistant, copied into OUT/assistant/, or a DFlash "
              "drafter, into OUT/dflash/; checked against SRC, copied as published.")
def convert(src: str, out: Path, quantize: bool, q_bits: int | None, q_group_size: str | None,
            q_mode: str, quant_recipe: str | None, overrides: tuple[str, ...],
            dtype: str | None, mtp_policy: str | None, mtp_bits: int, mtp_group_size: str,
            force: bool, upload_repo: str | None, dry_run: bool, drafter: str | None) -> None:
    """Convert SRC (HF folder, cached repo id, MLX/MTP bundle, or .gguf) into the bundle OUT."""
    click.echo("convert: loading mlx-lm", err=True)  # its import alone takes seconds
    from mtpkit.convert.convert import ConvertOptions
    from mtpkit.convert.convert import convert as run_convert

    try:
        parsed = [parse_override(o) for o in overrides]
    except ValueError as exc:
        _fail("usage", str(exc), "see mtpkit convert --help")
    with _user_errors("OUT"):
        quant = QuantOptions(quantize=quantize or bool(quant_recipe), bits=q_bits,
                             group_size=int(q_group_size) if q_group_size else None, mode=q_mode,
                             recipe=quant_recipe, overrides=parsed, dtype=dtype)
        sidecar = SidecarOptions(policy=mtp_policy or ("layers" if quant.quantize else "keep"),
                                 bits=mtp_bits, group_size=int(mtp_group_size))
    if quant.implied:
        click.echo("note: quantization options given without -q: quantizing the trunk (as -q)",
                   err=True)
    options = ConvertOptions(quant=quant, sidecar=sidecar, force=force, drafter=drafter,
                             command=_as_command(click.get_current_context()))
    bar = click.progressbar(length=1, label="writing", file=sys.stderr, width=30)
    started = False

    def on_plan(total: int) -> None:
        nonlocal started
        bar.length, started = max(total, 1), True
        bar.__enter__()

    try:
        with _user_errors("OUT"):
            result = run_convert(src, out, options, progress=bar.update, on_plan=on_plan,
                                 status=lambda text: click.echo(f"convert: {text}", err=True))
    finally:
        if started:
            bar.render_finish()
    m = result.manifest
    click.echo(f"wrote {result.out}: {len(m['files'])} files, "
               f"MTP {'sidecar ' + m['mtp']['file'] if m['mtp']['present'] else 'none'}"
               + (f" (policy {m['mtp']['policy']})" if m["mtp"]["present"] else ""))
    for f in result.findings:
        click.echo(f"  {f.severity} {f.code}: {f.message}")
    if upload_repo:
        from mtpkit.convert.upload import upload, upload_plan

        plan = upload_plan(result.out, upload_repo)
        click.echo(json.dumps(plan, indent=2) if dry_run else upload(result.out, upload_repo))


PROMPT_BYTES = 16 << 20  # a prompt read from stdin or a file: past any context, short of trouble


def _refused(flag: str, why: str, instead: str) -> Callable[[click.Context, click.Parameter,
                                                             object], None]:
    """An option of mlx-lm's whose meaning mtpkit does not have: a usage error that says so."""
    def refuse(_ctx: click.Context, _param: click.Parameter, value: object) -> None:
        if value is not None:
            _fail("options.unsupported", f"{flag} is not an mtpkit option: {why}", instead)

    return refuse


def _bundle_and_prompt(bundle: str | None, prompt: str | None, model: str | None,
                       prompt_opt: str | None) -> tuple[str, str]:
    """BUNDLE and PROMPT as positionals or as mlx-lm's --model / --prompt: the options take
    their place, the positionals fill what is left in order."""
    given = [x for x in (bundle, prompt) if x is not None]
    if model is None:
        if not given:
            _fail("usage", "missing BUNDLE", "mtpkit generate BUNDLE PROMPT (or --model BUNDLE)")
        model = given.pop(0)
    if prompt_opt is None:
        if not given:
            _fail("usage", "missing PROMPT", "mtpkit generate BUNDLE PROMPT ('-' reads stdin, "
                  "@FILE a file; or --prompt TEXT)")
        prompt_opt = given.pop(0)
    if given:
        _fail("usage", f"unexpected argument {given[0]!r}: BUNDLE and PROMPT are given already "
              "(--model / --prompt take their places)", "drop the argument or the option")
    return model, prompt_opt


def _prompt_text(value: str) -> str:
    """PROMPT as typed; '-' reads stdin (as mlx-lm does), @FILE reads FILE ('@@' keeps one
    literal '@'), both as UTF-8 text of at most PROMPT_BYTES."""
    if value.startswith("@@"):
        return value[1:]
    if value == "-":
        if sys.stdin.isatty():
            click.echo("reading the prompt from stdin (end it with Ctrl-D)", err=True)
        where, data = "stdin", click.get_binary_stream("stdin").read(PROMPT_BYTES + 1)
    elif value.startswith("@"):
        where = value[1:]
        try:
            with open(where, "rb") as f:
                data = f.read(PROMPT_BYTES + 1)
        except OSError as exc:
            _fail("prompt.unreadable", f"cannot read the prompt file {where}: "
                  f"{exc.strerror or exc}", "check the path after @ (a literal leading @ is "
                  "written @@)")
    else:
        return value
    if len(data) > PROMPT_BYTES:
        _fail("prompt.unreadable", f"the prompt from {where} is over {PROMPT_BYTES >> 20} MiB",
              "pass a shorter text (--max-prompt-tokens bounds it in tokens)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail("prompt.unreadable", f"the prompt from {where} is not UTF-8 text (byte "
              f"{exc.start})", "pass a text file")
        return ""


@main.command(epilog=EXAMPLES_GENERATE)
@click.argument("bundle", required=False)
@click.argument("prompt", required=False)
@click.option("--model", help="The bundle, as mlx-lm names it (then the one argument is PROMPT).")
@click.option("-p", "--prompt", "prompt_opt", metavar="TEXT",
              help="PROMPT as an option (mlx-lm's spelling); '-' reads stdin, @FILE a file.")
@click.option("--raw", "--ignore-chat-template", "raw", is_flag=True,
              help="Feed PROMPT as plain text, not as a chat message.")
@click.option("--system-prompt", metavar="TEXT", help="A system message before PROMPT (chat "
              "messages only; the bundle's chat template places it).")
@click.option("-m", "--max-tokens", type=click.IntRange(1, 1 << 20), default=256,
              show_default=True)
@click.option("--depth", default="auto", show_default=True, callback=lambda c, p, v: _depth(v),
              help="auto: each round's depth chosen from this machine's measured costs (mtpkit "
              "tune) and the acceptance so far; N: draft depth N every round (0: plain).")
@click.option("--temperature", "--temp", "temperature", type=click.FloatRange(0), default=0.0,
              show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0)
@click.option("--top-k", type=click.IntRange(0), default=0)
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.0)
@click.option("--seed", type=int, help="Make sampling reproducible.")
@click.option("--dtype", type=DTYPES, default="auto", show_default=True, help=DTYPE_HELP)
@click.option("--keep-quantized", is_flag=True, help=KEEP_QUANTIZED_HELP)
@click.option("--rollback", type=click.Choice(["record", "replay"]), default="record",
              show_default=True, help="How linear-attention state returns to the last kept "
              "token: recorded per verify position, or a snapshot plus replay.")
@click.option("--compare", is_flag=True,
              help="Run plain decoding first (both warmed up) and report the measured speedup.")
@click.option("--draft", type=DRAFT_CHOICE, help=DRAFT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (generation schema).")
@click.option("--max-prompt-tokens", type=click.IntRange(1), help=PROMPT_HELP)
@click.option("--shard", type=click.Choice(["tensor", "pipeline"]), help=SHARD_HELP)
@click.option("--max-kv-size", hidden=True, expose_value=False, callback=_refused(
    "--max-kv-size", "mlx-lm's rotating KV cache drops the oldest context, which exact "
    "verification cannot do without", "mtpkit keeps the whole context: bound it with "
    "--max-prompt-tokens N and --max-tokens N"))
@click.option("--draft-model", metavar="PATH", help=DRAFT_MODEL_HELP)
@_kv_options
@_leads
def generate(bundle: str | None, prompt: str | None, model: str | None, prompt_opt: str | None,
             raw: bool, system_prompt: str | None, max_tokens: int, depth: str | int,
             temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
             dtype: str | None, keep_quantized: bool, rollback: str, compare: bool,
             draft: str | None, as_json: bool, max_prompt_tokens: int | None,
             shard: str | None, draft_model: str | None, kv_bits: int | None,
             kv_group_size: int, quantized_kv_start: int) -> None:
    """Generate from BUNDLE with the reference MTP decoder (exact: greedy output equals plain).
    PROMPT '-' reads stdin, @FILE a file; mlx-lm's --model, --prompt, --temp, --system-prompt
    mean what they mean there."""
    from mtpkit.decoder.compare import Comparison, baseline
    from mtpkit.decoder.model.blas import note
    from mtpkit.decoder.rounds.interrupt import first_ctrl_c
    from mtpkit.decoder.runner import load, numerics_note
    from mtpkit.decoder.sharded.distributed import lead
    from mtpkit.verify.run import depths_text
    from mtpkit.verify.tune import ReferenceBar, progress_bar

    bundle, prompt = _bundle_and_prompt(bundle, prompt, model, prompt_opt)
    if system_prompt is not None and raw:
        _fail("usage", "--system-prompt is a chat message, --raw feeds plain text",
              "drop --raw, or put the system text into PROMPT")
    text = _prompt_text(prompt)
    if not text:
        _fail("prompt.empty", "PROMPT is empty: there is nothing to "
              + ("continue" if raw else "answer"), "give some text ('-' reads stdin, @FILE a "
              "file)")
    doing = [f"loading {bundle}: nothing generated"]  # what a Ctrl-C would interrupt
    result = plain = None
    interrupted = threading.Event()
    try:
        with _user_errors("OUT"):
            runner = lead(load(bundle, "auto" if not keep_quantized else False, dtype=dtype,
                               rollback=rollback, shard=shard, draft_model=draft_model,
                               **_kv(kv_bits, kv_group_size, quantized_kv_start)))
            runner.max_prompt_tokens = max_prompt_tokens
            source = runner.draft_source(depth, draft)
            # without --raw a chat message, always: a bundle without a usable template is
            # refused (template.missing, as serve's 400), never fed the prompt as raw text
            system = [] if system_prompt is None else [{"role": "system",
                                                        "content": system_prompt}]
            message = text if raw else [*system, {"role": "user", "content": text}]
            ids = runner.encode(message)  # as stream would: the bound is checked before any work
            runner.check_prompt(len(ids))
            for advice in (note(), numerics_note(runner)):  # once the prompt is accepted
                if advice:
                    click.echo(advice, err=True)
            sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                        "min_p": min_p, "seed": seed}
            if depth == "auto":  # the cost curve (read, or measured with a bar on stderr)
                doing[0] = ("measuring this machine's verify costs: nothing generated or cached "
                            "(the next --depth auto run measures again; --depth N needs none)")
                runner.costs(progress=progress_bar())
            # the warm-up (--compare) runs at the deepest depth
            deepest = runner.policy(depth, source)[0]
            if compare:
                doing[0] = "warming up for --compare: nothing generated"
                shown = ReferenceBar(max_tokens)

                def told(done: int, most: int) -> None:
                    doing[0] = (f"--compare's plain reference run ({done} of up to {most} "
                                f"tokens): no comparison, depth {depth} not run")
                    shown(done, most)

                plain = baseline(runner, ids, max_tokens, deepest, told, shown.stage,
                                 **sampling)
            doing[0] = "decoding (a second Ctrl-C): the text above stands, without statistics"
            with first_ctrl_c(interrupted.set):  # ends between rounds: sharded ranks in step
                for piece in runner.stream(ids, max_tokens, depth=depth, draft=draft,
                                           stop=interrupted.is_set, **sampling):
                    if not as_json:
                        click.echo(piece.text, nl=False)
                    result = piece.result or result
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted while {doing[0]}", err=True)
        raise SystemExit(1) from None
    assert result is not None
    if interrupted.is_set():
        click.echo(f"\ninterrupted after {len(result.tokens)} tokens", err=True)
        if plain is not None:
            click.echo(f"--compare: the plain reference finished ({len(plain.tokens)} tokens, "
                       f"{plain.stats.decode_tps:.1f} tok/s); depth {depth} decoded "
                       f"{len(result.tokens)} tokens at {result.stats.decode_tps:.1f} tok/s before "
                       "the interrupt: no speedup claimed (not the same length)", err=True)
        raise SystemExit(1)
    stats = result.stats.to_dict()
    comparison = Comparison(plain, result, temperature == 0.0) if plain is not None else None
    if as_json:
        doc = {"bundle": bundle, "text": result.text, "tokens": result.tokens,
               "finish_reason": result.finish_reason, "stats": stats}
        if comparison is not None:
            doc["compare"] = comparison.to_dict()
        click.echo(json.dumps(doc, indent=2))
        return
    accept = " / ".join(f"{100 * a:.0f}%" for a, n in zip(
        stats["acceptance_by_depth"], result.stats.proposed[:stats["drafted_depth"]], strict=True)
                        if n) or "-"
    chosen = (f"depth auto (depths {depths_text(stats['depths'])})" if stats["depths"]
              else f"depth {stats['depth']}")
    if stats["sources"]:
        chosen += ", " + ", ".join(f"{name} {v['rounds']} rounds" for name, v in
                                   stats["sources"].items())
    click.echo(f"\n[{stats['generated_tokens']} tokens, {chosen}, acceptance "
               f"{accept}, {stats['mean_accepted']:.2f} accepted/verify, decode "
               f"{stats['decode_tps']:.1f} tok/s, TTFT {1000 * stats['ttft_s']:.0f} ms, prefill "
               f"{stats['prefill_tps']:.0f} tok/s]", err=True)
    if comparison is not None:
        same = {True: "yes", False: "NO", None: "n/a (sampling)"}[comparison.identical]
        predicted = stats["predicted_speedup"]
        click.echo(f"[plain {comparison.plain.stats.decode_tps:.1f} tok/s -> depth {depth} "
                   f"{stats['decode_tps']:.1f} tok/s: speedup {comparison.speedup:.2f}x"
                   + (f" (predicted {predicted:.2f}x)" if predicted else "")
                   + f"; tokens identical to plain: {same}]", err=True)


@main.command(epilog=EXAMPLES_TUNE)
@click.argument("bundle")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (tune schema).")
@click.option("--refresh", is_flag=True, help="Measure again even when the cache has the curve.")
@click.option("--dtype", type=DTYPES, default="auto", show_default=True,
              help="Cast the weights as generate/serve --dtype do (each dtype has its own curve).")
@click.option("--max-batch", "batch", type=int, default=None,
              help="Also time batched rounds of up to N rows (serve --max-batch N then prices "
              "its batches' passes from them, not from the single-sequence curve).")
@_kv_options
def tune(bundle: str, as_json: bool, refresh: bool, dtype: str | None,
         batch: int | None, kv_bits: int | None, kv_group_size: int,
         quantized_kv_start: int) -> None:
    """Measure (or read the cached) cost curve --depth auto decides by, for BUNDLE here."""
    from mtpkit.decoder.options import batch_option
    from mtpkit.decoder.runner import load
    from mtpkit.verify.tune import batch_lines, progress_bar, render_text, report

    with _user_errors("--out"):
        most = batch_option(batch) if batch is not None else None
        runner = load(bundle, dtype=dtype, **_kv(kv_bits, kv_group_size, quantized_kv_start))
        if most is not None:
            batch_option(most, runner.kv, runner.unbatchable)  # refused before measuring
        doc = report(runner, bundle, refresh, progress_bar(), most,
                     batch_lines())
    click.echo(json.dumps(doc, indent=2) if as_json else render_text(doc))


@main.command(epilog=EXAMPLES_GRAFT)
@click.argument("bundle")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True)
@click.option("--corpus", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Text files or folders (repeatable). Default: the Python standard library.")
@click.option("--steps", type=click.IntRange(1), help="Training steps (stops at steps or minutes).")
@click.option("--minutes", type=click.FloatRange(0, min_open=True),
              help="Budget of the whole command, scoring and writing included (default 27 "
              "when --steps is not given).")
@click.option("--seq-len", type=click.IntRange(8, 4096), default=128, show_default=True)
@click.option("--batch", type=click.IntRange(1, 512), default=8, show_default=True)
@click.option("--learning-rate", type=click.FloatRange(0, min_open=True), default=1e-3,
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--draft-vocab", type=click.IntRange(0), default=8192, show_default=True,
              help="Draft over the corpus's N most frequent tokens (cheaper drafts); 0: all.")
@click.option("--copy-weight", type=click.FloatRange(0), default=1.0, show_default=True,
              help="Weight of the loss that points attention at text to copy; 0: off.")
@click.option("--mtp-policy", type=click.Choice(POLICIES), default="keep", show_default=True)
@click.option("--mtp-bits", type=click.IntRange(2, 8), default=4, show_default=True)
@click.option("--mtp-group-size", type=click.Choice(["32", "64", "128"]), default="64",
              show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT if it exists, and graft over an MTP "
              "head BUNDLE already has (refused otherwise: graft.has_head).")
@click.pass_context
def graft(ctx: click.Context, bundle: str, out: Path, corpus: tuple[Path, ...],
          steps: int | None, minutes: float | None, seq_len: int, batch: int,
          learning_rate: float, seed: int, draft_vocab: int, copy_weight: float,
          mtp_policy: str, mtp_bits: int,
          mtp_group_size: str, force: bool) -> None:
    """Train an MTP head for BUNDLE on its frozen trunk (self-distillation) and write OUT."""
    from mtpkit.decoder.model.blas import describe
    from mtpkit.train.graft import GraftOptions, blas_warning
    from mtpkit.train.graft import graft as run_graft
    from mtpkit.train.scoring import Plan

    with _user_errors("--out"):
        sidecar = SidecarOptions(policy=mtp_policy, bits=mtp_bits, group_size=int(mtp_group_size))
    options = GraftOptions(
        corpus=list(corpus) or None, steps=steps, minutes=minutes, seq_len=seq_len, batch=batch,
        learning_rate=learning_rate, seed=seed, draft_vocab=draft_vocab,
        copy_weight=copy_weight, force=force, command=_as_command(ctx), sidecar=sidecar)

    for line in (describe(), blas_warning()):
        if line:
            click.echo(line, err=True)

    def on_plan(plan: Plan) -> None:
        c = plan.costs
        head = (f"budget {plan.total_s / 60:.1f} min: {plan.setup_s / 60:.1f} min loading, "
                f"{plan.training_s / 60:.1f} min rollouts + training" if options.minutes
                else f"training {options.steps} steps")
        click.echo(f"{head}, then ~{plan.scoring_s / 60:.1f} min scoring {plan.raw} raw + "
                   f"{plan.chat} chat held-out prompts and ~{plan.writing_s / 60:.1f} min writing "
                   f"(measured here: decode step {1000 * c.step_s:.0f} ms, depth-1 round "
                   f"{1000 * c.round_s:.0f} ms, prefill {1000 * c.prefill_s:.1f} ms/token)",
                   err=True)

    doing = ["loading the bundle and planning"]  # what a Ctrl-C would interrupt

    def report(p) -> None:
        eta = f", ETA {p.eta_s / 60:.1f} min" if p.eta_s is not None else ""
        of = f"/{p.total}" if p.total else ""
        if p.phase == "trunk":
            what = f"trunk rollouts {p.step}{of} windows"
        elif p.phase == "score":
            what = f"scoring {p.total} held-out prompts"
        else:
            what = f"graft step {p.step}{of}  loss {p.loss:.4f}"
        doing[0] = f"{' '.join(what.split())} ({p.elapsed_s / 60:.1f} min in)"
        click.echo(f"\r{what}  {p.elapsed_s / 60:.1f} min{eta}", err=True, nl=False)

    existed = out.exists()
    try:
        with _user_errors("--out"):
            result = run_graft(bundle, out, options, progress=report, on_plan=on_plan)
    except KeyboardInterrupt:
        kept = (f"{out} was written before it" if out.exists() and not existed else
                f"nothing written to {out}" + (" (left as it was)" if existed else ""))
        click.echo(f"\ninterrupted during {doing[0]}: {kept}. graft writes OUT whole at the end "
                   "and keeps no checkpoint, so a new run starts over (--steps N or --minutes M "
                   "make a shorter one)", err=True)
        raise SystemExit(1) from None
    acc = result.graft["held_out_acceptance"]
    speed = result.graft["expected_speedup"]
    click.echo(f"\nwrote {result.out}: {result.graft['steps']} steps, final loss "
               f"{result.graft['final_loss']:.4f}, held-out depth-1 acceptance "
               f"{100 * acc['depth1']:.1f}% over {acc['rounds']} rounds"
               + (f" (chat requests {100 * acc['chat']['depth1']:.1f}% over "
                  f"{acc['chat']['rounds']})" if "chat" in acc else ""))
    if speed["pays"]:
        click.echo(f"expected depth-1 decoding here: {speed['depth1']:.2f}x of plain (a round "
                   f"costs {speed['round_steps']:.2f} plain steps)")
    else:
        click.echo(f"this head will not speed decoding up here: {speed['why']}")


EXAMPLES_SERVE = """
\b
Examples:
  mtpkit serve ./bundle                            # 127.0.0.1:8080, depth auto (per round)
  mtpkit serve ./bundle --depth 2 --port 9000
  MTPKIT_API_KEY="$KEY" mtpkit serve ./bundle --host 0.0.0.0   # or --api-key-file PATH
  mtpkit serve ./bundle --api-key "$KEY_A" --api-key "$KEY_B"   # several clients
  mtpkit serve ./bundle --cache-gb 8 --max-queue 4   # a bigger prefix cache, a shorter line
  mtpkit serve ./bundle --max-prompt-tokens 32768    # refuse longer prompts (400)
  mtpkit serve ./bundle --kv-bits 4 --max-batch 1    # 4-bit KV cache, one request at a time
\b
Endpoints: POST /v1/chat/completions, POST /v1/completions (OpenAI; SSE with "stream": true,
the final chunk carries usage with MTP statistics), POST /v1/messages (Anthropic), GET
/v1/models, /health, /metrics (Prometheus). Extensions: "mtp_depth" ("auto" or 0-16),
"mtp_draft" ("head", "lookup" or "both").
"""


@main.command(epilog=EXAMPLES_SERVE)
@click.argument("bundle")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
              help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (needed off "
              "loopback); repeat it for several clients, each with its own share of the prefix "
              "cache. A command line shows in ps: prefer $MTPKIT_API_KEYS (comma-separated), "
              "$MTPKIT_API_KEY or --api-key-file.")
@click.option("--api-key-file", type=click.Path(path_type=Path),
              help="Read the API keys from this file, one per line ('#' comments skipped).")
@click.option("--max-prompt-tokens", type=click.IntRange(1), help=PROMPT_HELP)
@click.option("--depth", "depth_opt", default="auto", show_default=True, callback=lambda c, p, v:
              _depth(v), help="MTP draft depth of requests that name none, or auto: chosen per "
              "round from this machine's cost curve (measured at start-up, cached).")
@click.option("--draft", type=DRAFT_CHOICE,
              help=DRAFT_HELP + " Requests may name their own (\"mtp_draft\").")
@click.option("--max-tokens", type=click.IntRange(1, 1 << 16), default=4096, show_default=True,
              help="Ceiling on any request's max_tokens.")
@click.option("--dtype", type=DTYPES, default="auto", show_default=True, help=DTYPE_HELP)
@click.option("--keep-quantized", is_flag=True, help=KEEP_QUANTIZED_HELP)
@click.option("--cache-gb", type=click.FloatRange(0), default=2.0, show_default=True,
              help="Memory bound of the prefix cache (prompt states reused by the prompts that "
              "start with them); 0 turns it off.")
@click.option("--max-queue", type=click.IntRange(0, 4096), default=16, show_default=True,
              help="Requests that may wait behind the running one (first in, first out); one "
              "more gets 503 with Retry-After.")
@click.option("--max-batch", type=int, default=8, show_default=True,
              callback=lambda c, p, v: _max_batch(v),
              help="Requests decoded together in one batch, each at its own depth (1: one at a "
              "time). --shard serves one at a time.")
@click.option("--verbose", is_flag=True, help="Log every request to stderr (and, with --depth "
              "auto, the cost curve at start-up).")
@click.option("--shard", type=click.Choice(["tensor", "pipeline"]), help=SHARD_HELP)
@click.option("--draft-model", metavar="PATH", help=DRAFT_MODEL_HELP)
@_kv_options
@_leads
def serve(bundle: str, host: str, port: int, api_keys: tuple[str, ...],
          api_key_file: Path | None,
          max_prompt_tokens: int | None, depth_opt: str | int, draft: str | None,
          max_tokens: int, dtype: str | None, keep_quantized: bool, cache_gb: float,
          max_queue: int, max_batch: int, verbose: bool, shard: str | None,
          draft_model: str | None, kv_bits: int | None, kv_group_size: int,
          quantized_kv_start: int) -> None:
    """Serve BUNDLE over an OpenAI-compatible API with the reference MTP decoder."""
    import os

    from mtpkit.decoder.options import batch_option
    from mtpkit.decoder.runner import load, numerics_note
    from mtpkit.decoder.sharded.distributed import lead
    from mtpkit.serve.server import Server, api_keys_from, check_bind, check_port
    from mtpkit.serve.service import Service
    from mtpkit.verify.tune import batch_lines, batch_summary, progress_bar, summary

    doing = [f"loading {bundle}"]  # what a Ctrl-C would interrupt
    try:
        with _user_errors("--out"):
            keys = api_keys_from(api_keys, api_key_file, os.environ)
            check_bind(host, keys)  # before the (slow) load
            check_port(host, port)
            runner = lead(load(bundle, "auto" if not keep_quantized else False, dtype=dtype,
                               shard=shard, draft_model=draft_model,
                               **_kv(kv_bits, kv_group_size, quantized_kv_start)))
            alone = kv_bits is not None or not runner.batchable  # (decoder/options.py)
            if alone and click.get_current_context().get_parameter_source(
                    "max_batch") is click.core.ParameterSource.DEFAULT:
                max_batch = 1  # a quantized KV cache, a sliding window: one at a time
            batch_option(max_batch, runner.kv, runner.unbatchable)  # --max-batch N asked: refused
            runner.max_prompt_tokens = max_prompt_tokens
            source = runner.draft_source(depth_opt, draft)
            if advice := numerics_note(runner):
                click.echo(advice, err=True)
            if depth_opt == "auto":  # the cost curve now, so that no request pays for it
                doing[0] = "measuring this machine's verify costs (nothing cached)"
                click.echo(summary(runner, draft, verbose, progress_bar()), err=True)
                if max_batch > 1 and shard is None:  # and what its batches' rounds cost
                    doing[0] = ("timing batched rounds (the verify costs are cached, the "
                                "batch prices not)")
                    runner.batch_costs(max_batch, told=batch_lines(max_batch))
                    click.echo(batch_summary(runner), err=True)  # (once per bundle, as tune's)
            service = Service(runner, Path(bundle).name, depth_opt, max_tokens, draft,
                              cache_bytes=int(cache_gb * (1 << 30)) if shard is None else 0,
                              max_queue=max_queue, max_batch=max_batch)  # sharded: no prefix
            # cache (followers hold none) and one generation at a time
            server = Server(service, host, port, keys, verbose)
    except KeyboardInterrupt:
        click.echo(f"\nserve: interrupted while {doing[0]}: not serving", err=True)
        raise SystemExit(1) from None
    drafts = f", drafts {source}" if depth_opt != 0 else ""
    together = (f"up to {service.max_batch} requests at once" if service.max_batch > 1 else
                "one request at a time" + (" (--shard serves one at a time)"
                                           if shard is not None and max_batch > 1 else "")
                + (" (--kv-bits: mlx-lm has no batched quantized cache)" if kv_bits else "")
                + (f" (this model: {runner.unbatchable})" if not runner.batchable else ""))
    how = ""
    try:
        click.echo(f"serving {bundle} on http://{host}:{server.server_address[1]}/v1 "
                   f"(MTP depth {depth_opt}){drafts}, {together}; chat page at /", err=True)
        server.serve_forever()  # the first Ctrl-C stops it after the round in flight
    except KeyboardInterrupt:  # a second one, or one before serving began
        how = " at once"
    finally:
        server.server_close()
    cut = int(server.worker.cut is not None) + len(server.worker.cuts)
    click.echo(f"serve: stopped{how}; {cut} request{'s' * (cut != 1)} in flight cancelled "
               "(their clients, and any still waiting, were answered 503)", err=True)


EXAMPLES_VERIFY = """
\b
Examples:
  mtpkit verify-run ./bundle                                   # local, depth auto vs plain
  mtpkit verify-run ./bundle --runs 5 --min-accept 0.5 --min-speedup 1.2 --stamp
  mtpkit verify-run --endpoint http://127.0.0.1:8080 --api-key "$KEY" --json
  mtpkit verify-run ./bundle --json > today.json --report today.html --compare last-week.json
\b
Exit codes: 0 every check passed, 1 a check failed or a floor was not met, 2 bad input.
"""


@main.command("verify-run", epilog=EXAMPLES_VERIFY)
@click.argument("bundle", required=False)
@click.option("--endpoint", help="An OpenAI-compatible server URL instead of a local bundle.")
@click.option("--api-key")
@click.option("--json", "as_json", is_flag=True, help="Print the report (verify_run schema).")
@click.option("--stamp", is_flag=True, help="Write the record into the bundle's mtpkit.json and card.")
@click.option("--depth", "depth_opt", default="auto", show_default=True,
              callback=lambda c, p, v: _depth(v), help="MTP depth, or auto: chosen per round "
              "by the target (a target that takes only numbers: the fastest of 1-4 here).")
@click.option("--draft", type=DRAFT_CHOICE,
              help="Draft source of the MTP requests (\"mtp_draft\" to an endpoint). Default: "
              "the target's (local: both with --depth auto, the head at a forced depth, lookup "
              "for a bundle without a head).")
@click.option("--loads", default="code,memo,translation", show_default=True)
@click.option("--runs", type=click.IntRange(1, 100),
              help="Measured runs per load and mode [default: 3; 1 on a CPU backend].")
@click.option("--max-tokens", type=click.IntRange(16, 1 << 16),
              help="Tokens per measured run [default: 256; 128 on a CPU backend].")
@click.option("--min-accept", type=click.FloatRange(0, 1), help="Fail below this depth-1 acceptance.")
@click.option("--min-speedup", type=click.FloatRange(0), help="Fail below this MTP speedup.")
@click.option("--timeout", type=click.FloatRange(0.1), default=60.0, show_default=True,
              help="Seconds an endpoint may stay silent before it counts as stalled.")
@click.option("--request-timeout", type=click.FloatRange(0.1), metavar="SECONDS",
              help="Endpoints: the wall seconds one request may take, however it streams "
              "[default: --timeout plus a second per token asked for].")
@click.option("--dtype", type=DTYPES, default="auto", show_default=True,
              help="Local bundles: " + DTYPE_HELP)
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Also write the "
              "run as one self-contained HTML page with charts (written even when checks fail).")
@click.option("--compare", type=click.Path(path_type=Path), metavar="EARLIER.json",
              help="With --report: overlay an earlier verify-run --json document's numbers.")
@click.option("--shard", type=click.Choice(["tensor", "pipeline"]), help=SHARD_HELP)
@click.option("--draft-model", metavar="PATH", help=DRAFT_MODEL_HELP)
@_kv_options
@_leads
def verify_run(bundle: str | None, endpoint: str | None, api_key: str | None, as_json: bool,
               stamp: bool, depth_opt: str | int, draft: str | None, loads: str, runs: int | None,
               max_tokens: int | None, min_accept: float | None, min_speedup: float | None,
               timeout: float, request_timeout: float | None, dtype: str | None,
               report_path: Path | None, compare: Path | None, shard: str | None,
               draft_model: str | None, kv_bits: int | None, kv_group_size: int,
               quantized_kv_start: int) -> None:
    """Check BUNDLE (or --endpoint) end to end and measure its speed the honest way."""
    from mtpkit.decoder.rounds.interrupt import first_ctrl_c
    from mtpkit.verify.endpoint import EndpointError, open_endpoint, serving_checks
    from mtpkit.verify.loads import LOADS
    from mtpkit.verify.local import cpu_backend, open_local
    from mtpkit.verify.record import fingerprint, machine, require_manifest
    from mtpkit.verify.record import stamp as write_stamp
    from mtpkit.verify.report import check_writable, load_earlier
    from mtpkit.verify.report import write as write_report
    from mtpkit.verify.run import Facts, VerifyOptions, run, table
    from mtpkit.verify.tune import progress_bar

    if (bundle is None) == (endpoint is None):
        _fail("usage", "give a BUNDLE or --endpoint URL (not both)", "see mtpkit verify-run --help")
    if stamp and endpoint:
        _fail("usage", "--stamp writes into a local bundle", "drop --stamp or pass BUNDLE")
    if shard and endpoint:
        _fail("usage", "--shard splits a local bundle", "drop --shard or pass BUNDLE")
    if kv_bits is not None and endpoint:
        _fail("options.invalid", "--kv-bits quantizes a local bundle's KV cache; an endpoint's "
              "is its server's", "start the server with it (mtpkit serve --kv-bits N), or pass "
              "BUNDLE")
    if draft_model is not None and endpoint:
        _fail("options.invalid", "--draft-model drafts for a local bundle; an endpoint drafts "
              "with what its server loaded", "start the server with it (mtpkit serve "
              "--draft-model PATH), or pass BUNDLE")
    chosen = tuple(x.strip() for x in loads.split(",") if x.strip())
    if not chosen or set(chosen) - set(LOADS):
        _fail("usage", f"--loads takes a comma list of {', '.join(LOADS)}", "e.g. --loads code")
    if compare and not report_path:
        _fail("usage", "--compare overlays an earlier run on --report's page", "add --report PATH")
    with _user_errors("--out"):
        earlier = load_earlier(compare) if compare else None  # bad inputs before the long run
        if report_path:
            check_writable(report_path)
        try:
            if endpoint:
                target, view = open_endpoint(endpoint, api_key, timeout, request_timeout), None
                facts = Facts("endpoint", endpoint)
            else:
                assert bundle is not None
                from mtpkit.decoder.sharded.distributed import lead

                target, facts, view = open_local(
                    bundle, dtype, shard, {**_kv(kv_bits, kv_group_size, quantized_kv_start),
                                           "draft_model": draft_model})
                lead(target.service.runner).draft_source(depth_opt, draft)
        except EndpointError as exc:
            _fail("endpoint.unreachable", str(exc), "check --endpoint and that the server runs")
        if stamp and view is not None:
            require_manifest(view.root)  # before the (long) run
        options = VerifyOptions.sized(runs, max_tokens, view is not None and cpu_backend(),
                                      depth=depth_opt, loads=chosen, min_accept=min_accept,
                                      min_speedup=min_speedup, draft=draft)
        # the cost curve before any timed request: no run's TTFT pays for measuring it
        stopped = threading.Event()
        try:
            costs = target.costs(depth_opt, progress_bar()) if view is not None else None
        except KeyboardInterrupt:  # nothing measured yet: the report says so, marked incomplete
            costs = None
            stopped.set()
        with first_ctrl_c(stopped.set):  # the first Ctrl-C ends after the request in flight
            report = run(target, facts, options, progress=lambda s: click.echo(
                f"verify-run: {s}", err=True), stop=stopped.is_set, costs=costs)
        if report.interrupted:
            click.echo(f"verify-run: interrupted after {report.interrupted['runs_measured']} of "
                       f"{report.interrupted['runs_planned']} runs: reporting what was measured "
                       "(marked incomplete)", err=True)
        elif endpoint:  # across requests: a second turn over the prefix cache, the Messages API
            report.checks += serving_checks(target, lambda s: click.echo(f"verify-run: {s}",
                                                                         err=True))
        report.record = {"machine": machine(), **({"fingerprint": fingerprint(view)} if view
                                                   else {"endpoint": endpoint})}
        if view is not None and (kv := target.service.runner.kv) is not None:
            report.record["kv_cache"] = kv.to_dict()  # the speed is the quantized cache's
        if view is not None and report.speed:
            report.speed["costs"] = costs or target.costs(depth_opt)
        doc = report.to_dict()
        if stamp and view is not None and not report.interrupted:
            write_stamp(view.root, doc)
        if report_path:
            write_report(doc, report_path, earlier, compare and compare.name)
            click.echo(f"verify-run: report written to {report_path}", err=True)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(table(doc))
    raise SystemExit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
