"""What a run holds, in words: ``Run.summary`` (plain JSON-able values, what
``tensortape info`` prints), its ``repr`` and its HTML table for notebooks."""

from __future__ import annotations

import html

from tensortape.recorder import format as fmt

from ._events import events_of
from ._index import RunIndex
from ._stats import Statistics
from ._tensors import Tensors

__all__ = ["as_html", "as_text", "summary"]

COUNTERS = ("events_total", "dropped", "outside_steps", "over_budget", "bytes_raw")


def summary(index: RunIndex, statistics: Statistics, tensors: Tensors,
            rank: int | None = None) -> dict:
    """The layers and steps of ``rank`` (default: the first), and, with no rank
    asked, the events and counters of every rank, with a line per rank;
    ``damaged``: each chunk missing from the committed rows, in words."""
    every = rank is None and len(index.ranks) > 1
    rank = index.rank(rank)
    kinds = index.kinds_of(rank)
    stats_layers = {k: set(index.stats_layers(k, rank)) for k in kinds}
    tensor_paths = {k: tensors.paths(k, rank) for k in kinds}
    layers = {layer: {k: {"stats": layer in stats_layers[k],
                          "tensor_bytes": tensors.nbytes(tensor_paths[k][layer], rank)
                          if layer in tensor_paths[k] else None} for k in kinds}
              for layer in index.layers_of(rank)}
    steps = {}
    for k in kinds:
        s = statistics.steps(k, rank)
        steps[k] = {"count": len(s), "first": int(s[0]) if len(s) else None,
                    "last": int(s[-1]) if len(s) else None,
                    "tensor_steps": len(tensors.steps(k, rank)) if tensor_paths[k] else 0}
    attrs = index.attrs
    return {"path": index.path, "status": attrs.get("status", "unknown"),
            "format": attrs.get("tensortape_format"), "model_class": attrs.get("model_class"),
            "torch_version": attrs.get("torch_version"), "ranks": index.ranks,
            "rank": rank, "kinds": kinds, "steps": steps, "layers": layers,
            "recordings": max((index.states[r].recording for r in index.ranks), default=0) + 1,
            **_liveness(index, attrs.get("status")),
            "events": [e.to_json() for e in events_of(index, None if every else rank)],
            "damaged": index.damage_notes(None if every else [rank]),
            **_counters(index, [r for r in index.ranks if every or r == rank]),
            "per_rank": [{"rank": r, "last_step": index.states[r].last_step,
                          **_counters(index, [r])} for r in index.ranks] if every else None}


def _liveness(index: RunIndex, status) -> dict:
    """When the run was last committed (``last_commit``: ISO time, UTC, of the
    newest rank state written), and for a run still ``recording``, whether a live
    job holds it (``job_alive``: None when that cannot be known)."""
    import datetime
    import fsspec
    when = None
    try:
        fs, root = fsspec.core.url_to_fs(index.path)
        for r in index.ranks:
            info = fs.info(f"{root.rstrip('/')}/{fmt.rank_group(r)}/zarr.json")
            t = info.get("mtime") or info.get("LastModified") or info.get("created")
            t = t.timestamp() if hasattr(t, "timestamp") else t
            if isinstance(t, (int, float)):
                when = max(when or t, t)
    except Exception:                  # an HDF5 export, a store without that file
        when = None
    alive = None
    if status == fmt.STATUS_RECORDING:
        from tensortape.recorder.liveness import recording_job
        job = recording_job(index.path)
        alive = bool(job and job["alive"])
    return {"last_commit": None if when is None else datetime.datetime.fromtimestamp(
        when, datetime.timezone.utc).isoformat(timespec="seconds"), "job_alive": alive}


def _counters(index: RunIndex, ranks: list[int]) -> dict:
    return {k: sum(getattr(index.states[r], k) for r in ranks) for k in COUNTERS}


def as_text(s: dict) -> str:
    """A summary as a few lines (``repr``)."""
    lines = [f"<tensortape Run {s['path']!r} status={s['status']} ranks={s['ranks']}>"]
    for k, v in s["steps"].items():
        lines.append(f"  {k}: " + (f"steps {v['first']}..{v['last']} ({v['count']} with "
                                   f"statistics)" if v["count"] else "no statistics"))
    lines.append(f"  {len(s['layers'])} layers: " + ", ".join(list(s["layers"])[:6])
                 + (" ..." if len(s["layers"]) > 6 else ""))
    ev = s["events"]
    lines.append(f"  {s['events_total']} non-finite events" + (
        f", first at step {ev[0]['step']} in {ev[0]['layer']!r} ({ev[0]['kind']})" if ev else ""))
    return "\n".join(lines)


def as_html(s: dict) -> str:
    """A summary as an HTML table of layers x kinds (notebooks)."""
    from dask.utils import format_bytes
    head = "".join(f"<th>{html.escape(k)}</th>" for k in s["kinds"])
    cell = lambda m: ("S" if m["stats"] else "") + (  # noqa: E731
        f" T {format_bytes(m['tensor_bytes'])}" if m["tensor_bytes"] is not None else "")
    rows = "".join(f"<tr><td>{html.escape(layer)}</td>" + "".join(
        f"<td>{cell(v[k])}</td>" for k in s["kinds"]) + "</tr>"
        for layer, v in list(s["layers"].items())[:200])
    ev = s["events"]
    return (f"<div><b>tensortape run</b> <code>{html.escape(s['path'])}</code> — status "
            f"<b>{html.escape(s['status'])}</b>, {s['events_total']} non-finite events"
            + (f" (first: step {ev[0]['step']}, {html.escape(ev[0]['layer'])}, "
               f"{ev[0]['kind']})" if ev else "")
            + f"<table><tr><th>layer</th>{head}</tr>{rows}</table>"
            "<small>S = statistics, T = full tensors (their size decoded)</small></div>")
