"""The tensortape command line: parse the arguments, call ``analysis`` or
``recorder``, print what they return.

Every library error becomes a ``click.ClickException`` (one line on stderr, exit
status 2) in one place, the group's ``invoke``; ``--debug`` shows the traceback
instead.  Everything a command prints goes through ``_out``, which turns a closed
stdout (``tensortape nan RUN | head -1``) into silence, so the exit status stays
the command's own; the CLI changes no process state (``sys.stdout``,
``sys.path``) beyond a command's own scope.  torch is imported only by ``demo``,
``record`` and ``replay``; matplotlib only by the commands that draw.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import click

from tensortape.recorder.errors import ConfigError, RecorderError, command_line
from tensortape.recorder.format import CAPTURES, COUNT_STATS, KINDS, STATS

INTEGERS = COUNT_STATS + ("delta_count", "delta_nan", "delta_posinf", "delta_neginf",
                          "worst_step", "rel_l2_step")
EXIT_ERROR = 2


# --- output ------------------------------------------------------------------------
def _out(text: str = "", nl: bool = True, color: bool | None = None) -> None:
    """Write to stdout.  A reader that went away silences the rest of the output
    instead of failing, so the command runs on to its own exit status."""
    try:
        click.echo(text, nl=nl, color=color)
    except BrokenPipeError:
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    """stdout's reader closed the pipe: point file descriptor 1 at devnull, so that
    later writes and the interpreter's flush at exit succeed (the note on SIGPIPE
    in Python's ``signal`` docs).  ``sys.stdout`` itself stays as it is."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):      # no file descriptor to point
        pass
    finally:
        os.close(devnull)


def _flush_stdout() -> None:
    """Flush what is left in stdout's buffer (a recorded script's prints) before
    the interpreter's flush at exit, which would turn a closed pipe into status 120."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
    except (AttributeError, OSError, ValueError):      # no stdout, or the script closed it
        pass


def _json(obj) -> None:
    _out(json.dumps(obj, indent=1, allow_nan=False, default=str))


def _table(columns, rows) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for r in rows:
        t.add_row(*map(str, r))
    console = Console(soft_wrap=True)
    with console.capture() as text:
        console.print(t)
    _out(text.get(), nl=False, color=True)             # rich chose whether to colour


# --- the group: errors, --help and --version ------------------------------------------
class TensortapeError(click.ClickException):
    """A library error, or a store that cannot be read: one line, exit status 2."""
    exit_code = EXIT_ERROR


def _show_help(ctx, param, value) -> None:
    if value and not ctx.resilient_parsing:
        _out(ctx.get_help(), color=ctx.color)
        ctx.exit()


def _show_version(ctx, param, value) -> None:
    if value and not ctx.resilient_parsing:
        from importlib.metadata import PackageNotFoundError, version
        try:
            number = version("tensortape")
        except PackageNotFoundError:
            number = "unknown"
        _out(f"tensortape, version {number}", color=ctx.color)
        ctx.exit()


class _HelpThroughOut:
    """``--help`` printed by ``_out``: click's own printing, on a closed stdout,
    would replace ``sys.stdout`` and exit 1."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.callback = _show_help
        return option


class _Command(_HelpThroughOut, click.Command):
    pass


class _Group(_HelpThroughOut, click.Group):
    command_class = _Command

    def parse_args(self, ctx, args):
        """``--debug`` anywhere on the line (before a ``--``) is the group's flag."""
        cut = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:cut]:
            args = ["--debug"] + [a for i, a in enumerate(args) if a != "--debug" or i > cut]
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except Exception as e:
            if ctx.params.get("debug"):
                raise
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if not isinstance(e, (RecorderError, OSError)):
                msg = f"{type(e).__name__}: {msg} (run with --debug for the traceback)"
            raise TensortapeError(msg) from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_show_version, help="Show the version and exit.")
@click.option("--debug", is_flag=True, help="show the traceback of an error")
def cli(debug):
    """Record and study what flows through a PyTorch model (tensortape)."""


# --- warnings ----------------------------------------------------------------------------
def _reading(command):
    """A reading command whose tensortape warnings (a damaged store, runs not
    alike) are each said once, as a line ``warning: ...`` on stderr, when issued."""
    import functools

    @functools.wraps(command)
    def run(*args, **kwargs):
        import warnings
        from tensortape.recorder.errors import TensortapeWarning
        said, show = set(), warnings.showwarning

        def say(message, category, *rest, **kw):
            if not issubclass(category, TensortapeWarning):
                return show(message, category, *rest, **kw)
            text = str(message).removeprefix("tensortape: ")
            if text not in said:
                said.add(text)
                click.echo(f"warning: {text}", err=True)
        with warnings.catch_warnings():
            warnings.simplefilter("always", TensortapeWarning)
            warnings.showwarning = say
            return command(*args, **kwargs)
    return run


# --- arguments -------------------------------------------------------------------------
def _open(path):
    from tensortape.analysis import open_run
    return open_run(path)


def _progress(label: str):
    """A progress bar over items on a terminal; plain iteration otherwise."""
    def wrap(items):
        if sys.stderr.isatty():
            with click.progressbar(list(items), file=sys.stderr, label=label) as bar:
                yield from bar
        else:
            yield from items
    return wrap


def _span(text):
    """``--steps A:B`` (either side may be empty) as a slice of step numbers (None: all)."""
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        span = slice(int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a step range; write A:B (steps A to B-1), "
                                 f"A: or :B", param_hint="--steps") from None
    if span.start is not None and span.stop is not None and span.start >= span.stop:
        raise click.BadParameter(f"{text!r} holds no step: A:B is steps A to B-1, so A must be "
                                 f"below B", param_hint="--steps")
    return span


def _check_step(step, have) -> None:
    """``--step N`` must be one of ``have``; else one line naming the run's steps."""
    from tensortape.analysis._select import steps_text
    if step is not None and step not in have:
        raise click.BadParameter(f"step {step} has no statistics; the run has "
                                 f"{steps_text(have)}", param_hint="--step")


def _given(ctx: click.Context, name: str) -> bool:
    """Whether the user wrote the option ``name`` (not its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source != click.core.ParameterSource.DEFAULT


def _flag(ctx: click.Context, name: str) -> str:
    """The option ``name`` as the user writes it (its longest flag)."""
    param = next(p for p in ctx.command.params if p.name == name)
    return max(param.opts, key=len)


def _refuse(ctx: click.Context, conflicts=(), only_for=None) -> None:
    """One line and exit 2 for flags that conflict or would do nothing:
    ``conflicts``, pairs of options not to be given together; ``only_for``,
    (option, choice option, the choices it applies to, why) where it is ignored
    under the other choices."""
    for x, y in conflicts:
        if _given(ctx, x) and _given(ctx, y):
            raise TensortapeError(f"{_flag(ctx, x)} and {_flag(ctx, y)} conflict; give one")
    for name, by, choices, why in only_for or ():
        if _given(ctx, name) and ctx.params[by] not in choices:
            raise TensortapeError(
                f"{_flag(ctx, name)} applies to {_flag(ctx, by)} {'|'.join(choices)} only; "
                f"{_flag(ctx, by)} {ctx.params[by]} {why}")


@contextlib.contextmanager
def _importable_from(folder: str):
    """``folder`` first on ``sys.path`` for the block (where ``python -m`` puts the
    working directory), and off it after."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


steps_option = click.option("--steps", default=None, metavar="A:B",
                            help="only steps A to B-1 (A: from A on, :B before B)")
kind_option = click.option("--kind", type=click.Choice(KINDS), default="activations",
                           show_default=True, help="which recorded tensors")
format_option = click.option("--format", "fmt", type=click.Choice(["table", "json"]),
                             default="table", show_default=True,
                             help='json: for scripts (counts are integers; NaN, Inf: "nan", "inf", "-inf")')


# --- the commands ----------------------------------------------------------------------
@cli.command()
@click.argument("out", type=click.Path())
@click.option("--steps", type=click.IntRange(min=1), default=None, help="training steps")
@click.option("--diverge", is_flag=True, help="use a learning rate that diverges to NaN")
def demo(out, steps, diverge):
    """Record a sample training run (a transformer learning to sort digits) into OUT."""
    from tensortape.sample_runs.task import record
    if os.path.exists(out):
        raise click.BadParameter(f"{out!r} already exists; choose a new OUT", param_hint="OUT")
    record(out, steps=steps, diverge=diverge, log=lambda s: click.echo(s, err=True))
    _out(repr(_open(out)))
    _out("\nTry next:")
    _out(f"  tensortape info {out}")
    _out(f"  tensortape nan {out}")
    layer = "encoder.layers.0.linear1"
    _out(f"  tensortape plot {out} --layer {layer} --type distribution -o dist.png")
    _out(f"  tensortape stats {out} --layer 'encoder.*' --format csv")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def _size(text: str, flag: str):
    """``auto``, ``none`` or a size (``500MB``, ``2GiB``, ``1e9``) -> max_bytes."""
    word = text.strip().upper()
    if word in ("AUTO", "NONE"):
        return word.lower() if word == "AUTO" else None
    number = word.rstrip("KMGTIB ")
    unit = word[len(number):].strip()
    try:
        n = int(float(number) * _UNITS[unit])
        if n < 1:
            raise ValueError
    except (ValueError, KeyError):
        raise click.BadParameter(f"{text!r} is not a size; use auto, none, or a size such as "
                                 f"500MB or 2GB", param_hint=flag) from None
    return n


# record's options that are the Recorder's arguments of the same name, passed as they are
RECORDER_FLAGS = ("mode", "tensors_every", "stats_every", "ring", "on_nonfinite", "max_samples")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="the run to write")
@click.option("--mode", type=click.Choice(["w-", "w", "a"]), default="w-", show_default=True,
              help="w-: create a new run; w: overwrite a tensortape run (never other files); "
                   "a: continue a run (a resumed job): its steps go on from the step after "
                   "the run's last, unless --start-step")
@click.option("--start-step", type=click.IntRange(min=0), default=None,
              help="the first step's number (default: 0, or with --mode a the step after the "
                   "run's last); each optimizer step adds 1")
@click.option("--layers", multiple=True, help="glob pattern of layers (repeatable; default all)")
@click.option("--capture", multiple=True, type=click.Choice(CAPTURES),
              help="what to record (repeatable; default activations and gradients)")
@click.option("--tensors-every", type=click.IntRange(min=0), default=None,
              help="persist full tensors every N steps (default 0: statistics only, and the "
                   "ring dumped at a NaN/Inf)")
@click.option("--stats-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="statistics and histograms every N steps (non-finite values are counted "
                   "at every step)")
@click.option("--ring", type=click.IntRange(min=0), default=None,
              help="keep the full tensors of the K steps before the current one in memory, "
                   "written out when a NaN/Inf appears (default: 2 where --on-nonfinite "
                   "dumps, else 0; more needs --on-nonfinite dump, raise or replay)")
@click.option("--on-nonfinite", type=click.Choice(["record", "dump", "raise", "replay"]),
              default="dump", show_default=True,
              help="on a NaN/Inf: record the event; dump: also write the ring and the step's "
                   "full tensors; raise: dump, then stop training with NonFiniteError; replay: "
                   "dump, and name the op and the line that made it (tensortape nan shows it)")
@click.option("--max-bytes", default="auto", show_default=True, metavar="SIZE",
              help="budget for full tensors on disk: auto (a tenth of the free space, at most "
                   "10 GB), none, or a size such as 500MB or 2GB; past it only statistics, "
                   "histograms and the non-finite dump are stored")
@click.option("--max-samples", type=click.IntRange(min=1), default=None,
              help="full tensors keep only their first K entries along dim 0 (statistics "
                   "still see the whole tensor)")
@click.option("--keep-going", is_flag=True,
              help="when the run cannot be recorded (the store exists, a pattern matches "
                   "nothing), let the script train unrecorded instead of stopping it")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@click.pass_context
def record(ctx, out, mode, start_step, layers, capture, tensors_every, stats_every, ring,
           on_nonfinite, max_bytes, max_samples, keep_going, command):
    """Record an unchanged training script: tensortape record -o RUN -- python train.py ARGS.

    The model is found at its first forward with grad enabled; a step is one optimizer
    step. Exits with the script's exit status (130 after Ctrl-C), or 2 with one line
    when it cannot record. SIGTERM (a scheduler's preemption) closes the run as
    'interrupted', then ends the process by SIGTERM as it would end python (status 143
    in a shell), unless the script's own SIGTERM handler decides otherwise."""
    from tensortape.recorder.script import run_script
    # the flags given, as the Recorder's arguments (the others: the Recorder's defaults)
    kw = {name: ctx.params[name] for name in RECORDER_FLAGS if _given(ctx, name)}
    if layers:
        kw["layers"] = list(layers)
    if capture:
        kw["capture"] = tuple(capture)
    if _given(ctx, "max_bytes"):
        kw["max_bytes"] = _size(max_bytes, "--max-bytes")
    with command_line():                           # messages name --flags, not arguments
        status = run_script(list(command), out, keep_going=keep_going, start_step=start_step,
                            **kw)
    sys.exit(status)


@cli.command()
@click.argument("run")
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="seconds between refreshes")
@click.option("--layer", "pattern", default=None,
              help="glob pattern of layers to show (default: all)")
@kind_option
@_reading
def watch(run, interval, pattern, kind):
    """Follow RUN while it is recorded: latest statistics per layer, non-finite alerts,
    steps per second. Ends when the run is closed."""
    import shutil
    from tensortape.analysis._watch import render, snapshots
    live = sys.stdout.isatty()
    view = None
    try:
        for view in snapshots(run, interval, pattern, kind):
            if live:                   # the first alert of each (layer, kind) stays on screen
                size = shutil.get_terminal_size()
                click.clear()
                _out("\n".join(render(view, size.columns, pinned=True, height=size.lines)))
            else:                      # piped: a status line a refresh, alerts as they come
                lines = render(view)
                _out("\n".join([lines[0]] + [x for x in lines if x.startswith("ALERT")]))
    except KeyboardInterrupt:          # Ctrl-C: the user is done watching; the run goes on
        _out(f"stopped watching {run}" + (f" (status {view['status']}, step {view['step']})"
                                          if view and "status" in view else ""))
        return
    if view is not None and not live:
        _out("\n".join(render(dict(view, alerts=[]))[1:]))
    _out(f"run {view['status'] if view else 'unknown'}: {run}")


@cli.command()
@click.argument("run")
@format_option
@_reading
def info(run, fmt):
    """Layers x kinds, steps, size on disk, status and events of RUN."""
    from dask.utils import format_bytes
    r = _open(run)
    s = r.summary()
    s["disk_bytes"] = r.disk_bytes()
    s["config"] = r.config
    if fmt == "json":
        return _json(s)
    _out(f"run      {run}")
    _out(f"status   {_status_words(s)}    ranks {s['ranks']}    format {s['format']}")
    if s["recordings"] > 1:
        _out(f"resumed  {s['recordings'] - 1} time{'s' * (s['recordings'] > 2)} (mode a): "
             f"{s['recordings']} recordings; a step recorded again reads as its latest")
    _out(f"model    {s['model_class']}    torch {s['torch_version']}")
    if s["config"]:
        _out(f"records  {_config_words(s['config'])}")
    raw, disk = s["bytes_raw"], s["disk_bytes"]
    ratio = f"    (full tensors recorded: {format_bytes(raw)}, {raw / disk:.2f}x the store)" \
        if disk and raw else ""
    _out(f"size     {format_bytes(disk)} on disk{ratio}")
    for k, v in s["steps"].items():
        _out(f"{k:<13} statistics at {_n(v['count'], 'step')} ({v['first']}..{v['last']}), "
             f"full tensors at {_n(v['tensor_steps'], 'step')}" if v["count"] else f"{k}: none")
    _out()
    _table(["layer", *s["kinds"]],
           [[layer] + [("S" if m[k]["stats"] else "") + (
               f"T {format_bytes(m[k]['tensor_bytes'])}" if m[k]["tensor_bytes"] is not None
               else "") or "-" for k in s["kinds"]] for layer, m in s["layers"].items()])
    _out("(S = statistics, T = full tensors, with their size decoded; name:0, name:1, ... are "
         "the tensors of a module that returns several, name:key a field of its output; "
         "name#1 its second call in a step)")
    ev = s["events"]
    several = s["per_rank"] is not None
    where = f" on rank {ev[0]['rank']}" if ev and several else ""
    _out(f"\nnon-finite events: {s['events_total']}" + (
        f"; first at step {ev[0]['step']}{where} in {ev[0]['layer']} ({ev[0]['kind']})"
        if ev else ""))
    if several:
        _out(f"(layers and steps above: rank {s['rank']}; every rank below)")
        _table(["rank", "last step", "events", "dropped"],
               [[p["rank"], p["last_step"], p["events_total"], p["dropped"]]
                for p in s["per_rank"]])
    if s["damaged"]:
        _out(f"damaged: {_n(len(s['damaged']), 'chunk')} of the committed rows missing from "
             f"the store; the rest reads as recorded:")
        for note in s["damaged"]:
            _out(f"  {note}")
    for key, what in (("dropped", "captures dropped (see drop_reasons in --format json)"),
                      ("outside_steps", "forward passes outside a step"),
                      ("over_budget", "full tensors not stored (max_bytes)")):
        if s[key]:
            _out(f"{what}: {s[key]}")


def _config_words(c: dict) -> str:
    """What the run was recorded to keep, from its stored configuration."""
    every = lambda n: "every step" if n == 1 else f"every {n} steps"     # noqa: E731
    tensors = "none" if c.get("tensors_every") is None else every(c["tensors_every"])
    ring = c.get("ring", 0)
    dump = (f", the ring of {_n(ring, 'step')} before and the step itself at a NaN/Inf"
            if ring and c.get("on_nonfinite") != "record" else
            ", the step itself at a NaN/Inf" if c.get("on_nonfinite") != "record" else "")
    stats = c.get("stats_every", 1)
    counted = "" if stats == 1 else " (NaN/Inf counted every step)"
    return (f"{', '.join(c.get('capture', ()))}: statistics {every(stats)}{counted}; "
            f"full tensors {tensors}{dump} (on_nonfinite={c.get('on_nonfinite')!r}, "
            f"tensors_every={c.get('tensors_every')!r}, ring={ring}, "
            f"max_bytes={c.get('max_bytes')!r})")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _status_words(s: dict) -> str:
    """The status, and for a run still ``recording``, whether a live job holds it
    and when it last committed (a killed job leaves ``recording`` behind)."""
    when = f"last commit {s['last_commit']}" if s.get("last_commit") else "no commit yet"
    if s["status"] != "recording":
        return s["status"]
    if s.get("job_alive"):
        return f"recording ({when})"
    return f"recording, or died (no live job holds the run; {when})"


@cli.command()
@click.argument("run")
@kind_option
@click.option("--layer", "pattern", default=None, help="glob pattern of layers (default: all)")
@click.option("--step", type=int, default=None, help="only this step")
@steps_option
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True, help="csv and json: for scripts (counts are integers)")
@click.option("--scalars", is_flag=True, help="the run's logged scalars (loss, lr, ...) instead: "
              "a row per step")
@click.pass_context
@_reading
def stats(ctx, run, kind, pattern, step, steps, fmt, scalars):
    """Per-step statistics of RUN: a row per (step, layer); counts are integers."""
    from tensortape.analysis._select import within
    _refuse(ctx, conflicts=[("step", "steps")])
    if scalars:
        default = click.core.ParameterSource.DEFAULT
        for name, flag in (("kind", "--kind"), ("pattern", "--layer")):
            if ctx.get_parameter_source(name) != default:
                raise click.BadParameter(f"{flag} does not apply to --scalars; drop one",
                                         param_hint=flag)
    ds = _open(run).scalars() if scalars else _open(run).stats(kind, pattern)
    _check_step(step, ds.step.values)
    try:
        ds = ds.sel(step=[step]) if step is not None else within(ds, _span(steps))
    except ConfigError as e:                     # no step in the range: name the flag
        raise click.BadParameter(str(e), param_hint="--steps") from None
    if scalars:
        ds = ds.transpose(*(d for d in ("rank", "step") if d in ds.dims))
        df = ds.to_dataframe().reset_index() if ds.data_vars else ds.step.to_dataframe()
    else:
        df = ds.compute().to_dataframe().reset_index()
    for c in COUNT_STATS if not scalars else ():
        df[c] = df[c].astype("Int64")
    if fmt == "json":
        numbers = ds.data_vars if scalars else STATS
        from tensortape.analysis._numbers import statistics_row
        _json([statistics_row({k: int(v) if k in ("step", "rank") else v for k, v in row.items()},
                              numbers, () if scalars else INTEGERS)
               for row in df.to_dict(orient="records")])
    elif fmt == "csv":
        _out(df.to_csv(index=False), nl=False)
    else:                                        # the header names the kind shown
        df = df if scalars else df.rename(columns={"layer": f"layer ({kind})"})
        _out(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


@cli.command()
@click.argument("run")
@click.option("--around", type=click.IntRange(min=0), default=3, show_default=True,
              help="steps of history to show")
@format_option
@_reading
def nan(run, around, fmt):
    """Post-mortem: the first non-finite (step, layer, kind), across every rank; exit 1
    if any, 0 if clean."""
    r = _open(run)
    first = r.first_nonfinite(history=around)
    if fmt == "json":
        _json(None if first is None else first.to_json())
    elif first is None:
        live = r.status == "recording"
        _out(f"clean{' so far' if live else ''}: no NaN or Inf recorded"
             + (" (the run is still recording)" if live else ""))
    else:
        ranks = len(r.ranks) > 1
        where = f" on rank {first.rank}" if ranks else ""
        _out(f"first non-finite: step {first.step}{where}, layer {first.layer}, {first.kind} "
             f"({first.phase}); in micro-batch {first.micro}: {first.nan} NaN, "
             f"{first.posinf} +Inf, {first.neginf} -Inf")
        if first.replay:
            _say_replay(first.replay)
        if first.history is not None:
            _out(f"\n{first.layer} ({first.kind}) in the steps before step {first.step}, "
                 f"and at it; each step whole (its micro-batches together):")
            h = first.history[["mean", "std", "abs_max", "norm", "nan", "posinf", "neginf"]]
            df = h.to_dataframe().drop(columns="layer", errors="ignore")
            for c in ("nan", "posinf", "neginf"):
                df[c] = df[c].astype("Int64")
            _out(df.to_string(float_format=lambda v: f"{v:.4g}"))
        if first.same_step:
            _out(f"\nalso non-finite at step {first.step}:")
            for e in first.same_step[:20]:
                _out(f"  {f'rank {e.rank}: ' if ranks else ''}{e.layer} ({e.kind}), in "
                     f"micro-batch {e.micro}: {e.nan} NaN, {e.posinf} +Inf, {e.neginf} -Inf")
            if len(first.same_step) > 20:
                _out(f"  ... and {len(first.same_step) - 20} more")
    sys.exit(0 if first is None else 1)


@cli.command()
@click.argument("run")
@click.option("--layer", required=True, help="layer name (a pattern for --type evolution)")
@kind_option
@click.option("--type", "plot_type", type=click.Choice(["histogram", "evolution", "distribution"]),
              default="histogram", show_default=True,
              help="histogram: one step over values; evolution: a statistic over steps, per "
                   "layer; distribution: the histogram over steps")
@click.option("--stat", type=click.Choice(STATS), default="std", show_default=True,
              help="statistic for --type evolution")
@click.option("--step", type=int, default=None,
              help="step for --type histogram (default: the last with finite values)")
@steps_option
@click.option("--scale", type=click.Choice(["linear", "symlog"]), default="linear",
              show_default=True,
              help="--type histogram: linear, density per unit of value (a Gaussian is one "
                   "bell); symlog, a symmetric-log value axis and density per decade of |value| "
                   "(for heavy tails)")
@click.option("--density/--counts", default=True, show_default=True,
              help="--type histogram: each bar's density (its area is its share of the "
                   "values), or the count in each bar")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True),
              help="PNG file to write")
@click.pass_context
@_reading
def plot(ctx, run, layer, kind, plot_type, stat, step, steps, scale, density, output):
    """Plot a layer of RUN into a PNG file."""
    _refuse(ctx, only_for=[
        ("step", "plot_type", ("histogram",), "draws every step (narrow them with --steps)"),
        ("steps", "plot_type", ("evolution", "distribution"), "draws one step (pick it with --step)"),
        ("stat", "plot_type", ("evolution",), "draws the histogram's counts, not a statistic"),
        ("density", "plot_type", ("histogram",), "has no such option"),
        ("scale", "plot_type", ("histogram",), "has no such option")])
    r = _open(run)
    if plot_type != "evolution" and any(ch in layer for ch in "*?["):
        raise click.BadParameter(f"a {plot_type} shows one layer; {layer!r} is a pattern (use "
                                 f"--type evolution for many, or name one layer)",
                                 param_hint="--layer")
    span = _span(steps)
    if plot_type == "histogram":
        _check_step(step, r.steps(kind))
        fig = r.plot_histogram(layer, kind=kind, steps=step, density=density, scale=scale)
    elif plot_type == "evolution":
        fig = r.plot_evolution(layers=layer, kind=kind, stat=stat, steps=span)
    else:
        fig = r.plot_distribution(layer, kind=kind, steps=span)
    fig.savefig(output, dpi=120)
    _out(output)


def _say_replay(found: dict) -> None:
    """What ``on_nonfinite="replay"`` found: the op, its two lines and its inputs."""
    from tensortape.analysis._events import replay_lines
    _out("\n".join(replay_lines(found)))


@cli.command()
@click.argument("run_a")
@click.argument("run_b")
@kind_option
@click.option("--layer", "pattern", default=None,
              help="glob pattern of layers to compare (default: all both runs hold)")
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-3, show_default=True,
              help="relative tolerance: runs differ where rel_l2 (full tensors) or any "
                   "statistic's relative difference is above it")
@format_option
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="PNG: where the runs differ (layer x step) and the first diverging layer")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="which rank of each run to compare (default: each run's first)")
@click.option("--strict", is_flag=True,
              help="refuse (exit 2) runs that are not alike: other model classes, other "
                   "recorded layers, or a shared layer of another shape")
@_reading
def compare(run_a, run_b, kind, pattern, rtol, fmt, output, rank, strict):
    """Compare two runs layer by layer; exit 1 when they diverge, 0 when they agree.

    It says which steps and layers each metric covers, where the runs first
    diverge (and whether full tensors or statistics show it), and per layer each
    metric at its worst step. Runs that share no layer of KIND: exit 2. Runs not alike
    (model classes, recorded layers, shapes): a warning, and only the shared layers
    whose shapes agree are compared (--strict: exit 2)."""
    from tensortape.analysis import compare_runs, plot_comparison
    from tensortape.analysis._compare import divergence, summarize
    from tensortape.analysis._select import layer_coord
    a, b = _open(run_a), _open(run_b)
    ds = compare_runs(a, b, kind=kind, layers=pattern, rank=rank, strict=strict,
                      progress=_progress("comparing tensors"))
    first = divergence(ds, rtol)
    table = summarize(ds)
    stats_steps = [int(x) for x in ds.step.values]
    by = None
    if first is not None:           # what shows it: the statistics, the full tensors, or both
        at = dict(step=[first[0]], layer=layer_coord([first[1]]))     # any name, exactly
        shown = [what for what, v in (("statistics", "stat_rel"), ("full tensors", "rel_l2"))
                 if v in ds and ds[v].sel(**at).item() > rtol]
        by = " and ".join(shown)
    if fmt == "json":
        from tensortape.analysis._numbers import number as json_number
        _json({"first_divergence": None if first is None else {"step": first[0],
                                                                "layer": first[1], "kind": kind,
                                                                "by": by},
               "coverage": {"statistics": {"steps": stats_steps,
                                           "layers": [str(x) for x in ds.layer.values]},
                            "full_tensors": {"steps": ds.attrs["tensor_steps"],
                                             "layers": ds.attrs["tensor_layers"]}},
               "layers": {str(layer): {k: json_number(table[k].values[j], k in INTEGERS)
                                       for k in table.data_vars}
                          for j, layer in enumerate(table.layer.values)}})
    else:
        if first is None:
            _out("no divergence")
        else:
            _out(f"first divergence: step {first[0]}, layer {first[1]} ({kind}), shown by {by}")
            if by == "statistics" and ds.attrs["tensor_steps"] and bool(
                    (ds["rel_l2"].fillna(0) <= rtol).all()):
                _out("  the full tensors agree at every step both runs hold them (every "
                     "micro-batch); the statistics differ")
        _out(f"compared {kind} of {ds.sizes['layer']} layers both runs hold:")
        _out(f"  statistics (delta_*, stat_rel): {ds['stat_rel'].attrs['covers'][12:]}")
        _out("  full tensors (rel_l2, cosine, max_abs, sqnr_db): " +
             (ds["rel_l2"].attrs["covers"][14:] if "rel_l2" in ds else
              "none (not both runs hold them)"))
        _out("per layer, each metric at its worst step (worst_step: where the statistics "
             "differ most):")
        frame = table.to_dataframe()
        _out(frame.to_string(float_format=lambda v: f"{v:.4g}"))
    if output:
        layer = first[1] if first else str(ds.layer.values[0])
        plot_comparison(a, b, layer, kind=kind, rtol=rtol, ds=ds, first=first,
                        rank=rank).savefig(output, dpi=120)
        if fmt != "json":
            _out(output)
    sys.exit(0 if first is None else 1)


@cli.command()
@click.argument("run")
@click.argument("run_b", required=False)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (anything but loopback: no authentication)")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="port to listen on (0: a free one)")
@click.option("--no-browser", is_flag=True, help="do not open a browser")
@_reading
def serve(run, run_b, host, port, no_browser):
    """Serve a browser view of RUN (or of RUN and RUN_B side by side), read-only."""
    from tensortape.analysis.browser._serve import loopback, make_server   # here: --help and the rest skip it
    paths = [run] + ([run_b] if run_b else [])
    try:
        server = make_server(paths, host, port)
    except RecorderError:
        raise                                   # a run that cannot be served: its own line
    except OSError as e:
        raise click.BadParameter(f"cannot listen on {host}:{port} ({e.strerror or e})",
                                 param_hint="--port") from None
    if not loopback(host):
        click.echo(f"warning: serving on {host}, which is not loopback: the view has no "
                   f"authentication, anyone who reaches {host} can read these runs", err=True)
    name, bound = server.server_address[:2]
    shown = f"[{name}]" if ":" in str(name) else name
    url = f"http://{shown}:{bound}/"
    _out(f"serving {' and '.join(paths)} at {url}")
    _flush_stdout()
    if not no_browser and (sys.platform != "linux" or os.environ.get("DISPLAY")
                           or os.environ.get("WAYLAND_DISPLAY")):
        import webbrowser
        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@cli.command()
@click.argument("run")
@click.argument("out", type=click.Path())
@click.option("--force", is_flag=True, help="overwrite OUT if it exists")
@click.option("--format", "to", type=click.Choice(["hdf5", "tensorboard"]), default="hdf5",
              show_default=True, help="tensorboard: event files in the folder OUT")
@_reading
def export(run, out, force, to):
    """Export RUN to one HDF5 file OUT (open_run reads it back with the same API), or
    with --format tensorboard to TensorBoard event files in the folder OUT."""
    if to == "tensorboard":
        from tensortape.analysis.export._tensorboard import existing_events, to_tensorboard
        if os.path.exists(out) and not os.path.isdir(out):
            raise click.BadParameter(f"{out!r} is a file; give a folder for the event files",
                                     param_hint="OUT")
        old = existing_events(out) if os.path.isdir(out) else []
        if old and not force:
            raise click.BadParameter(f"{out!r} holds TensorBoard event files; pass --force to "
                                     f"replace them, or choose a new folder", param_hint="OUT")
        for f in old:
            os.remove(f)
        _out(to_tensorboard(_open(run), out, progress=_progress("exporting")))
        return
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"the folder {folder!r} does not exist; create it first",
                                 param_hint="OUT")
    if os.path.exists(out) and not force:
        raise click.BadParameter(f"{out!r} exists; pass --force to overwrite it", param_hint="OUT")
    _out(_open(run).to_hdf5(out, progress=_progress("exporting")))


@cli.command()
@click.argument("old")
@click.argument("new")
@click.option("--mode", type=click.Choice(["w-", "w"]), default="w-", show_default=True,
              help="w-: NEW must not exist; w: overwrite a tensortape run at NEW (never "
                   "other files)")
def migrate(old, new, mode):
    """Convert OLD, a store of an older tensortape format (or an HDF5 export), into NEW
    in the current one (OLD is not changed; a failed copy leaves nothing behind)."""
    from tensortape.analysis._migrate import migrate as convert
    with command_line():
        _out(convert(old, new, progress=_progress("converting"), mode=mode))


@cli.command()
@click.argument("run")
@click.option("--model", "factory", required=True,
              help="pkg.module:factory, a function of no arguments that builds the model "
                   "(from the working directory or the Python path)")
def replay(run, factory):
    """Repeat RUN's replay (on_nonfinite="replay") in a model you build, and name the op
    and the line again; exit 0 when it is named, 1 when not."""
    import importlib
    module, _, name = factory.partition(":")
    if not module or not name:
        raise click.BadParameter(f"{factory!r} is not pkg.module:factory", param_hint="--model")
    with _importable_from(os.getcwd()):
        try:
            build = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise click.BadParameter(f"cannot import {factory!r} ({e})", param_hint="--model")
        found = _open(run).replay(build())
    _say_replay(found)
    sys.exit(0 if found.get("op") else 1)


def main(argv=None) -> None:
    """The console script: every error is one line on stderr (no usage block)."""
    try:
        rv = cli.main(args=argv, prog_name="tensortape", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except click.ClickException as e:
        click.echo(f"Error: {e.format_message().splitlines()[0]}", err=True)
        sys.exit(e.exit_code)
    finally:
        _flush_stdout()
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
