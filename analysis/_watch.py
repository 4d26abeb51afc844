"""Follow a run while it is recorded (``tensortape watch``).

Each refresh reopens the store (attributes only, then the last committed row of
the statistics), so it shows exactly what a reader may trust: the latest
statistics per layer, new non-finite events as alerts, and steps per second.
It ends when the run's status is no longer ``recording``.  While it is, a read
that fails (a shard rewritten as it is read, again and again) is a note on the
status line, and the next refresh reads again; once it is not, it is an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from tensortape.recorder import format as fmt
from tensortape.recorder.errors import StoreFormatError, StoreNotFoundError

from .browser._between import Between
from ._run import open_run

__all__ = ["render", "snapshots"]

COLUMNS = ("mean", "std", "abs_max", "zero_frac", "nan", "posinf", "neginf")


CREATING = 30.0            # seconds a folder may take to become a store before it is an error
RATE_WINDOW = 30.0          # seconds of step changes the rate is measured over


class _Rate:
    """Steps per second over a sliding window of the moments the committed step
    changed (a store commits every few seconds, so refreshes between two commits
    see no change: they keep the last rate instead of dropping to 0)."""

    def __init__(self, window: float = RATE_WINDOW):
        self.window, self.changes, self.value = window, [], None

    def see(self, now: float, step: int | None) -> float | None:
        if step is not None and (not self.changes or step != self.changes[-1][1]):
            self.changes.append((now, step))
            while len(self.changes) > 2 and now - self.changes[0][0] > self.window:
                self.changes.pop(0)
            (t0, s0), (t1, s1) = self.changes[0], self.changes[-1]
            if t1 > t0:
                self.value = (s1 - s0) / (t1 - t0)
        return self.value


ROOT_FILES = ("zarr.json", ".zgroup", ".zarray")   # a Zarr root of any version: a store


def _has_root(path) -> bool:
    """Whether the store's root metadata file exists (so it is not being created:
    a Zarr v2 root, which tensortape never writes, is a store too)."""
    import fsspec
    try:
        fs, root = fsspec.core.url_to_fs(str(path))
        return any(fs.exists(root.rstrip("/") + "/" + name) for name in ROOT_FILES)
    except Exception:
        return True


def _latest(run, kind: str, layers) -> tuple[int | None, list]:
    """The first rank's last committed step and its statistics per layer (None
    and none before the first commit)."""
    if kind not in run.kinds:
        return None, []
    ds = run.stats(kind, layers, rank=run.ranks[0])
    if not ds.sizes["step"]:
        return None, []
    row = ds.isel(step=-1).compute()
    return int(row.step), [(str(layer), {c: row[c].sel(layer=layer).item() for c in COLUMNS})
                           for layer in row.layer.values]


def snapshots(path, interval: float = 2.0, layers=None, kind: str = "activations",
              sleep: Callable[[float], None] = time.sleep) -> Iterator[dict]:
    """One view of the run per ``interval`` until it stops recording: its status,
    last committed step, steps per second (over a sliding window), the latest
    statistics per layer, one alert per (layer, kind) the first time it goes
    non-finite, and the count of non-finite events so far (every rank's, not
    only those the store keeps).  A refresh of a live run whose statistics cannot
    be read keeps the last ones and says why in ``note``."""
    alerted: set = set()
    pinned: list = []                 # every alert so far: the first event of each (layer, kind)
    rate, last = _Rate(), _LastNonfinite()
    shown = None, []                  # the last step and statistics read
    opened, since = False, time.monotonic()
    while True:
        try:
            run = open_run(path)
        except StoreNotFoundError as e:        # not created yet
            yield {"waiting": str(e)}
            sleep(interval)
            continue
        except StoreFormatError as e:          # being created (its folder, no root file
            if opened or _has_root(path) or time.monotonic() - since > CREATING:   # yet);
                raise                          # a store with a root file is damaged
            yield {"waiting": str(e)}
            sleep(interval)
            continue
        opened = True
        # every rank's events, counted past those kept (fmt.MAX_EVENTS a rank)
        view = {"status": run.status, "kind": kind, "step": None, "rate": None, "rows": [], "alerts": [],
                "events": sum(run.state(r).events_total for r in run.ranks),
                "nonfinite_layers": 0, "last_event": None}
        for e in run.events:
            if (e.layer, e.kind) not in alerted:
                alerted.add((e.layer, e.kind))
                view["alerts"].append(e)
                pinned.append(e)
        view["nonfinite_layers"] = len(alerted)
        try:
            view["last_event"] = last.see(run)
        except StoreFormatError:
            if run.status != fmt.STATUS_RECORDING:
                raise                          # read again at the next refresh while live
            view["last_event"] = last.step
        view["pinned"] = list(pinned)
        try:
            view["step"], view["rows"] = _latest(run, kind, layers)
        except StoreFormatError as e:
            if run.status != fmt.STATUS_RECORDING:
                raise                          # a store no longer written is damaged
            # a live run: a shard rewritten while it was read, past the source's own
            # reads again; the last statistics stay, and the next refresh tries again
            view.update(step=shown[0], rows=shown[1], note=f"statistics not refreshed, "
                        f"trying again in {interval:g} s: {str(e).splitlines()[0]}")
        shown = view["step"], view["rows"]
        view["rate"] = rate.see(time.monotonic(), view["step"])
        yield view
        if view["status"] != fmt.STATUS_RECORDING:
            return
        sleep(interval)


class _LastNonfinite:
    """The last step that held a NaN or an Inf, of any kind on any rank.  The events
    say it while the store keeps them all; past ``fmt.MAX_EVENTS`` a rank keeps its
    first ones only, so the statistics' NaN/Inf counts say it (the rows committed
    since the last look, each read once), with the counts of steps without
    statistics (``Between``: complete)."""

    def __init__(self):
        self.rows: dict = {}            # (rank, kind) -> stats rows looked at
        self.step: int | None = None

    def see(self, run) -> int | None:
        states = [run.state(r) for r in run.ranks]
        if all(len(st.events) == st.events_total for st in states):
            return max((e.step for e in run.events), default=None)
        for r in run.ranks:
            for kind in run.kinds_of(r):
                self._rows(run, kind, r)
                between = Between(run, kind, r, None, None).steps
                if len(between):
                    self._saw(int(between[-1]))
        return self.step

    def _rows(self, run, kind: str, rank: int) -> None:
        ds = run.stats(kind, rank=rank)
        n, done = ds.sizes["step"], self.rows.get((rank, kind), 0)
        if n < done:                    # rows recorded again (a resumed run): look anew
            done = 0
        if n > done:
            part = ds[list(COUNTS)].isel(step=slice(done, n)).compute()
            bad = (sum(part[k].clip(min=0) for k in COUNTS) > 0).any("layer").values
            if bad.any():
                self._saw(int(part.step.values[bad][-1]))
        self.rows[(rank, kind)] = n

    def _saw(self, step: int) -> None:
        self.step = step if self.step is None else max(self.step, step)


COUNTS = fmt.COUNT_STATS[1:]            # nan, posinf, neginf


def _alert(e) -> str:
    return (f"ALERT {e.layer} ({e.kind}) went non-finite at step {e.step} (micro-batch "
            f"{e.micro}): {e.nan} NaN, {e.posinf} +Inf, {e.neginf} -Inf")


def render(view: dict, width: int = 100, pinned: bool = False, height: int | None = None
           ) -> list[str]:
    """Lines of text for one view: a status line, the table, the alerts, and a
    summary of the non-finite events.  ``pinned`` (a screen redrawn in place):
    the alerts so far, the first step of each (layer, kind), stay under the status
    line, above the table, instead of only the new ones below it; ``height`` (a
    screen's lines): the status line and the first alert always fit, then as
    many alerts and table rows as the screen holds, each cut said in a line."""
    if "waiting" in view:
        return [f"waiting for the run: {view['waiting']}"]
    note = f"   ({view['note']})" if view.get("note") else ""
    alerts = [_alert(e) for e in view.get("pinned" if pinned else "alerts", [])]
    summary = ([f"non-finite so far: {view['events']} events in {view['nonfinite_layers']} "
                f"(layer, kind) pairs, the last at step {view['last_event']}"]
               if view["events"] else [])
    if view["step"] is None:
        status = f"status {view['status']}   waiting for the first commit{note}"
        table, summary = [], []
    else:
        rate = f"{view['rate']:.2f} steps/s" if view["rate"] is not None else "- steps/s"
        status = f"status {view['status']}   step {view['step']}   {rate}{note}"
        table = _table(view, width)
    if not pinned:
        return [status, *table, *alerts, *summary]
    if height is not None:          # the screen: status, the first alerts, the table's head
        rows = lambda lines: sum(-(-max(len(x), 1) // width) for x in lines)   # lines wrap
        room = max(height - 1 - rows([status, *summary]), 2)    # (the cursor's line kept free)
        keep = len(alerts)
        while keep > 1 and rows(alerts[:keep]) + (keep < len(alerts)) > room // 4:
            keep -= 1
        if keep < len(alerts):
            alerts = alerts[:keep] + [f"... and {len(alerts) - keep} more (layer, kind) pairs "
                                      f"went non-finite (tensortape nan RUN names the first)"]
        left = room - rows(alerts)
        each = rows(table[:1]) if table else 1              # a row of a narrow screen wraps
        if table and len(table) * each > max(left, 0):
            shown = max((left - 1) // each, 1)
            table = table[:shown] + [f"... {len(table) - shown} more layers (--layer PATTERN "
                                     f"shows fewer)"]
    return [status, *alerts, *table, *summary]


def _table(view: dict, width: int) -> list[str]:
    """The header and a row per layer: its latest statistics, or that it did not run."""
    if not view["rows"]:
        return []
    head = f"layer ({view['kind']})" if view.get("kind") else "layer"   # the kind shown
    cells_w = 10 * len(COLUMNS)
    name_w = max(min(max(len(head), *(len(n) for n, _ in view["rows"])), width - cells_w - 1),
                 12)
    lines = [fit(head, name_w).ljust(name_w) + "".join(f"{c:>10}" for c in COLUMNS)]
    for name, vals in view["rows"]:
        if vals["nan"] is None or vals["nan"] < 0:         # counts of -1: did not run
            cells = "   did not run at this step"
        else:
            cells = "".join(f"{int(vals[c]):>10d}" if c in fmt.COUNT_STATS
                            else f"{vals[c]:>10.3g}" for c in COLUMNS)
        lines.append(fit(name, name_w).ljust(name_w) + cells)
    return lines


def fit(name: str, width: int) -> str:
    """``name`` in ``width`` characters: whole, or with its inner words (between dots)
    left out from the left, numbers kept (``…31.post_attention_layernorm``: the block
    and the layer both show), and past that its last word cut in its middle."""
    if len(name) <= width:
        return name
    parts = name.split(".")
    keep = [True] * len(parts)
    for i in range(len(parts) - 1):
        if not parts[i].isdigit():
            keep[i] = False
            text = _joined(parts, keep)
            if len(text) <= width:
                return text
    head = _joined(parts[:-1], keep[:-1])
    head += "." if head and not head.endswith("…") else ""
    room = max(width - len(head), 3)
    last, tail = parts[-1], (room - 1) // 2
    return head + last[:room - 1 - tail] + "…" + last[len(last) - tail:]


def _joined(parts: list[str], keep: list[bool]) -> str:
    """The kept ``parts`` joined by dots, each run of left-out ones an ellipsis."""
    out = ""
    for p, k in zip(parts, keep):
        if k:
            out += p if not out or out.endswith("…") else "." + p
        elif not out.endswith("…"):
            out += "…"
    return out
