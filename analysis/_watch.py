"""Follow a run while it is recorded (``tensortape watch``).

Each refresh reopens the store (attributes only, then the last committed row of
the statistics), so it shows exactly what a reader may trust: the latest
statistics per layer, new non-finite events as alerts, and steps per second.
It ends when the run's status is no longer ``recording``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from recorder import format as fmt
from recorder.errors import StoreNotFoundError

from ._run import open_run

__all__ = ["watch"]

COLUMNS = ("mean", "std", "abs_max", "zero_frac", "nan", "posinf", "neginf")


def snapshots(path, interval: float = 2.0, layers=None, kind: str = "activations",
              sleep: Callable[[float], None] = time.sleep) -> Iterator[dict]:
    """One view of the run per ``interval`` until it stops recording: its status,
    last step, steps per second, the latest statistics per layer, and the events
    new since the last view."""
    seen_events = 0
    last = None
    while True:
        try:
            run = open_run(path)
        except StoreNotFoundError as e:        # not created yet; a damaged store is an error
            yield {"waiting": str(e)}
            sleep(interval)
            continue
        now = time.monotonic()
        view = {"status": run.status, "step": None, "rate": None, "rows": [], "alerts": []}
        events = run.events
        view["alerts"] = events[seen_events:]
        seen_events = len(events)
        if kind in run.kinds:
            ds = run.stats(kind, layers)
            if ds.sizes["step"]:
                row = ds.isel(step=-1).compute()
                view["step"] = int(row.step)
                view["rows"] = [(str(layer), {c: float(row[c].sel(layer=layer)) for c in COLUMNS})
                                for layer in row.layer.values]
        if last is not None and view["step"] is not None and last[1] is not None and now > last[0]:
            view["rate"] = (view["step"] - last[1]) / (now - last[0])
        last = (now, view["step"])
        yield view
        if view["status"] != fmt.STATUS_RECORDING:
            return
        sleep(interval)


def render(view: dict, width: int = 100) -> list[str]:
    """Lines of text for one view."""
    if "waiting" in view:
        return [f"waiting for the run: {view['waiting']}"]
    rate = f"{view['rate']:.2f} steps/s" if view["rate"] is not None else "- steps/s"
    lines = [f"status {view['status']}   step {view['step']}   {rate}"]
    if view["rows"]:
        name_w = min(max(len(n) for n, _ in view["rows"]), width - 70)
        lines.append("layer".ljust(name_w) + "".join(f"{c:>10}" for c in COLUMNS))
        for name, vals in view["rows"]:
            cells = "".join(f"{int(vals[c]):>10d}" if c in ("nan", "posinf", "neginf")
                            else f"{vals[c]:>10.3g}" for c in COLUMNS)
            lines.append(name[-name_w:].ljust(name_w) + cells)
    for e in view["alerts"]:
        lines.append(f"ALERT non-finite at step {e.step}: {e.layer} ({e.kind}, micro-batch "
                     f"{e.micro}): {e.nan} NaN, {e.posinf} +Inf, {e.neginf} -Inf")
    return lines
