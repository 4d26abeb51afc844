"""The tensortape command line: thin wrappers over ``analysis`` and ``sample_runs``.

Library errors become one line on stderr and exit status 2, in one place
(``main``).  torch and matplotlib are imported only by the commands that need them.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys

import click

EXIT_USAGE = 2


def _open(path):
    from analysis import open_run
    return open_run(path)


def _progress(label: str):
    """A wrapper that shows a progress bar over items on a terminal, and
    iterates plainly otherwise."""
    def wrap(items):
        if sys.stderr.isatty():
            with click.progressbar(list(items), file=sys.stderr, label=label) as bar:
                yield from bar
        else:
            yield from items
    return wrap


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Record and study what flows through a PyTorch model (tensortape)."""


@cli.command()
@click.argument("out", type=click.Path())
@click.option("--steps", type=click.IntRange(min=1), default=None, help="training steps")
@click.option("--diverge", is_flag=True, help="use a learning rate that diverges to NaN")
def demo(out, steps, diverge):
    """Record a sample training run (a transformer learning to sort digits) into OUT."""
    from sample_runs.task import record
    if os.path.exists(out):
        raise click.BadParameter(f"{out!r} already exists; choose a new OUT", param_hint="OUT")
    record(out, steps=steps, diverge=diverge, log=lambda s: click.echo(s, err=True))
    run = _open(out)
    click.echo(repr(run))
    click.echo("\nTry next:")
    click.echo(f"  tensortape info {out}")
    click.echo(f"  tensortape nan {out}")
    layer = "encoder.layers.0.linear1"
    click.echo(f"  tensortape plot {out} --layer {layer} --type distribution -o dist.png")
    click.echo(f"  tensortape stats {out} --layer 'encoder.*' --format csv")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="the run to write")
@click.option("--layers", multiple=True, help="glob pattern of layers (repeatable; default all)")
@click.option("--capture", multiple=True,
              type=click.Choice(["activations", "gradients", "inputs", "weights", "weight_grads"]),
              help="what to record (repeatable; default activations and gradients)")
@click.option("--tensors-every", type=click.IntRange(min=0), default=None,
              help="persist full tensors every N steps (0: statistics only; default 1)")
@click.option("--stats-every", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--ring", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--on-nonfinite", type=click.Choice(["record", "dump", "raise"]), default="record",
              show_default=True)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def record(out, layers, capture, tensors_every, stats_every, ring, on_nonfinite, command):
    """Record an unchanged training script: tensortape record -o RUN -- python train.py ARGS.

    The model is found at its first forward with grad enabled; a step is one optimizer
    step. Exits with the script's exit status."""
    from recorder._script import run_script
    kw = dict(layers=list(layers) or "*", stats_every=stats_every, ring=ring,
              on_nonfinite=on_nonfinite,
              tensors_every=None if tensors_every == 0 else (tensors_every or 1))
    if capture:
        kw["capture"] = tuple(capture)
    sys.exit(run_script(list(command), out, **kw))


@cli.command()
@click.argument("run")
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="seconds between refreshes")
@click.option("--layer", "pattern", default=None, help="glob pattern of layers")
@click.option("--kind", type=click.Choice(["activations", "gradients", "inputs", "weights",
                                            "weight_grads"]), default="activations",
              show_default=True)
def watch(run, interval, pattern, kind):
    """Follow RUN while it is recorded: latest statistics per layer, non-finite alerts,
    steps per second. Ends when the run is closed."""
    from analysis._watch import render, snapshots
    live = sys.stdout.isatty()
    view = None
    for view in snapshots(run, interval, pattern, kind):
        lines = render(view)
        if live:
            click.clear()
            click.echo("\n".join(lines))
        else:                          # piped: a status line a refresh, alerts as they come
            click.echo("\n".join([lines[0]] + [x for x in lines if x.startswith("ALERT")]))
    if view is not None and not live:
        click.echo("\n".join(render(dict(view, alerts=[]))[1:]))
    click.echo(f"run {view['status'] if view else 'unknown'}: {run}")


@cli.command()
@click.argument("run")
def info(run):
    """Layers x kinds, steps, size on disk, status and events of RUN."""
    r = _open(run)
    s = r.summary()
    click.echo(f"run      {run}")
    click.echo(f"status   {s['status']}    ranks {s['ranks']}    format {r.attrs.get('tensortape_format')}")
    click.echo(f"model    {r.attrs.get('model_class')}    torch {r.attrs.get('torch_version')}")
    disk = _disk_bytes(run)
    raw = s["bytes_raw"]
    ratio = f"    (full tensors recorded: {raw / 1e6:.1f} MB raw, {raw / disk:.2f}x the store)" if disk and raw else ""
    click.echo(f"size     {disk / 1e6:.1f} MB on disk{ratio}")
    for k, v in s["steps"].items():
        t = r.steps(k, tensors=True) if k in r.kinds else []
        click.echo(f"{k:<13} statistics at {v[2] if v else 0} steps ({v[0]}..{v[1]})"
                   f", full tensors at {len(t)} steps" if v else f"{k}: none")
    width = max([len(n) for n in s["layers"]] + [5])
    click.echo("\n" + "layer".ljust(width) + "  " + "  ".join(f"{k[:12]:>12}" for k in s["kinds"]))
    for layer, kinds in s["layers"].items():
        click.echo(layer.ljust(width) + "  " + "  ".join(f"{kinds[k] or '-':>12}" for k in s["kinds"]))
    click.echo("(S = statistics, T = full tensors, with their size decoded)")
    ev = s["events"]
    click.echo(f"\nnon-finite events: {len(ev)}" + (f"; first at step {ev[0].step} in "
               f"{ev[0].layer} ({ev[0].kind})" if ev else ""))
    if s["dropped"]:
        click.echo(f"dropped late gradients: {s['dropped']}")


def _disk_bytes(path: str) -> int:
    if "://" in path:
        return 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@cli.command()
@click.argument("run")
@click.option("--kind", default="activations", show_default=True)
@click.option("--layer", "pattern", default=None, help="glob pattern of layers")
@click.option("--step", type=int, default=None)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
def stats(run, kind, pattern, step, fmt):
    """Per-step statistics of RUN."""
    ds = _open(run).stats(kind, pattern)
    if step is not None:
        if step not in ds.step.values:
            raise click.BadParameter(f"step {step} has no statistics; try one of "
                                     f"{ds.step.values[:5].tolist()}", param_hint="--step")
        ds = ds.sel(step=[step])
    df = ds.compute().to_dataframe().reset_index()
    if fmt == "json":
        click.echo(json.dumps(json.loads(df.to_json(orient="records")), indent=1))
    elif fmt == "csv":
        buf = io.StringIO()
        df.to_csv(buf, index=False)
        click.echo(buf.getvalue(), nl=False)
    else:
        click.echo(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


@cli.command()
@click.argument("run")
@click.option("--around", type=click.IntRange(min=0), default=3, show_default=True,
              help="steps of history to show")
def nan(run, around):
    """Post-mortem: the first non-finite (step, layer, kind); exit 1 if any, 0 if clean."""
    first = _open(run).first_nonfinite(history=around)
    if first is None:
        click.echo("clean: no NaN or Inf recorded")
        sys.exit(0)
    click.echo(f"first non-finite: step {first.step}, layer {first.layer}, {first.kind} "
               f"({first.phase}): {first.nan} NaN, {first.posinf} +Inf, {first.neginf} -Inf")
    if first.history is not None:
        click.echo(f"\n{first.layer} ({first.kind}) in the steps before:")
        h = first.history[["mean", "std", "abs_max", "norm", "nan", "posinf", "neginf"]]
        click.echo(h.to_dataframe().drop(columns="layer", errors="ignore").to_string(
            float_format=lambda v: f"{v:.4g}"))
    if first.same_step:
        click.echo(f"\nalso non-finite at step {first.step}:")
        for e in first.same_step[:20]:
            click.echo(f"  {e.layer} ({e.kind}): {e.nan} NaN, {e.posinf} +Inf, {e.neginf} -Inf")
        if len(first.same_step) > 20:
            click.echo(f"  ... and {len(first.same_step) - 20} more")
    sys.exit(1)


@cli.command()
@click.argument("run")
@click.option("--layer", required=True, help="layer name (a pattern for --type evolution)")
@click.option("--kind", default="activations", show_default=True)
@click.option("--type", "kind_of_plot", type=click.Choice(["histogram", "evolution", "distribution"]),
              default="histogram", show_default=True)
@click.option("--stat", default="std", show_default=True, help="statistic for --type evolution")
@click.option("-o", "--output", required=True, type=click.Path(), help="PNG file to write")
def plot(run, layer, kind, kind_of_plot, stat, output):
    """Plot a layer of RUN into a PNG file."""
    r = _open(run)
    if kind_of_plot == "histogram":
        fig = r.plot_histogram(layer, kind=kind)
    elif kind_of_plot == "evolution":
        fig = r.plot_evolution(layers=layer, kind=kind, stat=stat)
    else:
        fig = r.plot_distribution(layer, kind=kind)
    fig.savefig(output, dpi=120)
    click.echo(output)


@cli.command()
@click.argument("run_a")
@click.argument("run_b")
@click.option("--kind", default="activations", show_default=True)
@click.option("--layer", "pattern", default=None, help="glob pattern of layers")
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-3, show_default=True)
@click.option("-o", "--output", type=click.Path(), default=None, help="PNG of the first diverging layer")
def compare(run_a, run_b, kind, pattern, rtol, output):
    """Compare two runs layer by layer and report where they first diverge."""
    from analysis import compare_runs, first_divergence, plot_comparison
    a, b = _open(run_a), _open(run_b)
    first = first_divergence(a, b, rtol=rtol)
    click.echo("no divergence" if first is None else f"first divergence: step {first[0]}, layer {first[1]}")
    ds = compare_runs(a, b, kind=kind, layers=pattern, progress=_progress("comparing full tensors"))
    cols = [c for c in ("rel_l2", "cosine", "sqnr_db", "delta_mean", "delta_std") if c in ds]
    summary = ds[cols].max("step") if "rel_l2" in ds else abs(ds[cols]).max("step")
    click.echo(summary.to_dataframe().to_string(float_format=lambda v: f"{v:.4g}"))
    if output:
        layer = first[1] if first else str(ds.layer.values[0])
        plot_comparison(a, b, layer, kind=kind).savefig(output, dpi=120)
        click.echo(output)


@cli.command()
@click.argument("run")
@click.argument("out", type=click.Path())
def export(run, out):
    """Export RUN to one HDF5 file OUT."""
    path = _open(run).to_hdf5(out, progress=_progress("exporting"))
    click.echo(path)


def main(argv=None) -> None:
    """Entry point: library errors become one line and exit status 2."""
    from recorder.errors import RecorderError
    try:
        rv = cli.main(args=argv, prog_name="tensortape", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except click.ClickException as e:
        click.echo(f"Error: {e.format_message()}".splitlines()[0], err=True)
        sys.exit(EXIT_USAGE)
    except (RecorderError, FileNotFoundError, FileExistsError, KeyError, ValueError) as e:
        msg = str(e).strip("'\"").splitlines()[0] if str(e) else type(e).__name__
        click.echo(f"Error: {msg}", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
