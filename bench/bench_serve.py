"""The browser view's server on a long run: the map's first answer, zooms, memory,
and the same data through TensorBoard's reader.

    python bench/bench_serve.py [--steps 100000] [--layers 200] [--out DIR] [--tb-steps 2000]
                                [--paint 3] [--live 10]

The store (statistics only, one kind) is written through the writer's store layer
(``recorder.store._store.RunStore.append_stats``, what the background writer calls),
with no model: recording 200 layers x 100,000 steps through hooks would take
hours on a 2-core machine and measure the recorder, not the view.  Each layer's
statistics drift smoothly; layer 117 has a one-step spike (x 1e4) at step
73,211 and layer 5 a NaN at step 88,000.  Each histogram row holds a few bins.
With ``--out`` the store is kept and reused by the next run.

Reported:
- with ``--paint N``: first paint in Chromium, N times: ``tensortape serve STORE --port 0
  --no-browser`` started as a user starts it, Debian's ``/usr/bin/chromium`` driven by
  Playwright, from ``page.goto`` to the page's ``data-ready`` (the run, the map and the
  scalars drawn), a new server and a new page each time; then a click on the spike's
  cell until the layer's evolution is drawn (the map's statistics, then every one);
- with ``--live N``: how soon a live run's new step shows, N times: a small model recorded
  in this process (statistics only), ``tensortape serve`` started on it as a user starts
  it, and after each step's ``rec.flush()`` (the step committed), the time until the
  server's ``/api/runs`` names it, and until the page in Chromium (when Playwright is
  installed) draws it as the map's last column, without a reload;
- the map's first answer (a new server, ``GET /api/map`` over every step at
  1,000 columns) and zooms (a window of 10,000, 1,000 and 100 steps), each the
  median of 5 over HTTP on loopback, and whether the spike and the NaN show;
- the server's memory for the map over windows of 10,000 to all steps
  (``tracemalloc`` peak of the Python and numpy allocations of one answer);
- TensorBoard: an event file with the same histograms (``add_histogram_raw``,
  first ``--tb-steps`` steps, all layers, the NaN count as a scalar), loaded by
  ``EventAccumulator`` keeping every histogram (``size_guidance`` 0) and with its
  defaults (500 a tag, sampled), against the same steps through ``/api/map``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPIKE, SPIKE_LAYER, NAN_STEP, NAN_LAYER = 73_211, 117, 88_000, 5


def names_of(layers: int) -> list[str]:
    return [f"layers.{i}.mlp" for i in range(layers)]


def rows(step: int, layers: int, rng) -> tuple[dict, np.ndarray]:
    """One step's statistics and histogram rows."""
    from tensortape.recorder import histogram
    base = 1.0 + 0.5 * np.sin(step / 5000 + np.arange(layers)) + 0.01 * rng.random(layers)
    st = {"count": np.full(layers, 4096.0), "mean": base * 0.01, "std": base,
          "min": -3 * base, "max": 3 * base, "abs_max": 3 * base, "norm": 64 * base,
          "zero_frac": np.zeros(layers), "nan": np.zeros(layers), "posinf": np.zeros(layers),
          "neginf": np.zeros(layers)}
    if step == SPIKE:
        for k in ("std", "max", "abs_max", "norm"):
            st[k][SPIKE_LAYER] *= 1e4
    if step == NAN_STEP:
        st["nan"][NAN_LAYER] = 7.0
    hist = np.zeros((layers, histogram.NBINS), np.int64)
    hist[:, histogram.ZERO_BIN + 60: histogram.ZERO_BIN + 70] = 400
    return st, hist


def write(loc: str, steps: int, layers: int) -> float:
    from tensortape.recorder import format as fmt
    from tensortape.recorder.claim._root import open_root
    from tensortape.recorder.store._store import RunStore
    names = names_of(layers)
    root = open_root(loc, "w", 0, attributes={"tensortape_format": fmt.FORMAT_VERSION,
                                              "status": "recording", "layers": names,
                                              "events": []})
    store = RunStore(root, 0, "auto")
    state = fmt.RankState(rank=0)
    state.layers = list(names)
    state.stats_layers["activations"] = list(names)
    rng = np.random.default_rng(0)
    path = fmt.stats_group(0, "activations")
    t0 = time.perf_counter()
    for step in range(steps):
        st, hist = rows(step, layers, rng)
        store.append_stats("activations", step, names, names, st, hist, state.committed.get(path, 0))
        state.last_step = step
        if step == NAN_STEP:
            state.events.append(fmt.NonFiniteEvent(step, names[NAN_LAYER], "activations", 7, 0, 0,
                                                   order=NAN_LAYER))
            state.events_total += 1
        if step % 5000 == 4999 or step == steps - 1:
            state.committed.update(store.flush())
            store.commit(state.to_json(), None)
            print(f"  wrote {step + 1} steps", file=sys.stderr, flush=True)
    store.close()
    root.update_attributes({"status": "complete"})
    return time.perf_counter() - t0


def get(url: str):
    with urllib.request.urlopen(url, timeout=600) as r:
        return json.loads(r.read())


def timed(url: str, n: int = 5) -> tuple[float, dict]:
    out, times = None, []
    for _ in range(n):
        t = time.perf_counter()
        out = get(url)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def serve(loc: str, warm: bool = False):
    from tensortape.analysis.browser._serve import make_server
    server = make_server([loc], "127.0.0.1", 0, warm=warm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def shows(m: dict, step: int, layer: str, nonfinite: bool) -> bool:
    col = next(c for c, (a, b) in enumerate(zip(m["step_lo"], m["step_hi"])) if a <= step <= b)
    row = m["layers"].index(layer)
    if nonfinite:
        return bool(m["nonfinite"][row][col])
    return m["values"][row][col] == max(v for v in m["values"][row] if isinstance(v, float))


def bench_server(loc: str, steps: int, layers: int) -> None:
    from tensortape.analysis.browser._api import GRAIN
    names = names_of(layers)
    t = time.perf_counter()
    server, url = serve(loc)
    started = time.perf_counter() - t
    t = time.perf_counter()
    m = get(f"{url}/api/map?stat=abs_max&width=1000")
    cold = time.perf_counter() - t
    server.shutdown()
    server.server_close()
    print(f"server: started (run opened and checked) in {started * 1e3:.0f} ms")
    print(f"  map, all {steps} steps x {layers} layers in {len(m['step_lo'])} columns, a new server "
          f"with nothing cached: first answer {cold * 1e3:.0f} ms")
    t = time.perf_counter()
    server, url = serve(loc, warm=True)
    warming = [th for th in threading.enumerate() if th.name == "tensortape-warm"]
    for th in warming:
        th.join()
    print(f"  a new server's cache of maxima (every statistic of the map, {layers} layers, "
          f"{steps // GRAIN} grains of {GRAIN} steps) filled in the background in "
          f"{time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    m = get(f"{url}/api/map?stat=abs_max&width=1000")
    first = time.perf_counter() - t
    warm, _ = timed(f"{url}/api/map?stat=abs_max&width=1000")
    t2, _ = timed(f"{url}/api/map?stat=rms&width=1000")
    print(f"  then the map's first answer {first * 1e3:.0f} ms, again {warm * 1e3:.0f} ms (median "
          f"of 5), another statistic (rms) {t2 * 1e3:.0f} ms; {len(m['step_lo'])} columns "
          f"(over HTTP: the client's download and JSON decoding included)")
    if steps > NAN_STEP:
        print(f"  the one-step spike (step {SPIKE}) is its row's peak: "
              f"{shows(m, SPIKE, names[SPIKE_LAYER], False)}; the NaN at step {NAN_STEP} "
              f"is marked: {shows(m, NAN_STEP, names[NAN_LAYER], True)}")
    from tensortape.analysis.browser._serve import answer
    served = server.RequestHandlerClass.served
    zooms = [("all steps", {})] + [
        (f"a zoom to {span:,} steps", {"start": [str(a)], "stop": [str(a + span)]})
        for span in (50_000, 10_000, 1_000, 100)
        for a in [max(0, min(SPIKE, steps) - span // 2)]]
    for label, q in zooms:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            with served.lock:
                body = json.dumps(answer(served, "/api/map", {"width": ["1000"], **q}),
                                  allow_nan=False, separators=(",", ":"))
            times.append(time.perf_counter() - t)
        print(f"  on the server (the answer and its JSON, no HTTP), {label}: "
              f"{statistics.median(times) * 1e3:.0f} ms, {len(body) / 1e6:.1f} MB of JSON")
    for span in (50_000, 10_000, 1_000, 100):
        a = max(0, min(SPIKE, steps) - span // 2)
        t, z = timed(f"{url}/api/map?stat=abs_max&width=1000&start={a}&stop={a + span}")
        print(f"  zoom to {span} steps ({len(z['step_lo'])} columns): {t * 1e3:.0f} ms")
    t, _ = timed(f"{url}/api/stats?layer={names[SPIKE_LAYER]}&width=280")
    print(f"  one layer's evolution (every statistic, 280 columns): {t * 1e3:.0f} ms")
    for part, stats in (("first (the map's statistics, from its grains)", "abs_max,std,norm,rms,nonfinite"),
                        ("then (the rest, from the rows)", "mean,min,max,zero_frac")):
        t, _ = timed(f"{url}/api/stats?layer={names[SPIKE_LAYER]}&width=280&stats={stats}")
        print(f"    as the page asks for it, {part}: {t * 1e3:.0f} ms")
    server.shutdown()
    server.server_close()
    from tensortape.analysis.browser import _api
    from tensortape.analysis import open_run
    run = open_run(loc)
    _, rows, _ = run._statistics.rows("activations", 0)
    for span in sorted({min(steps, s) for s in (10_000, 50_000, steps)}):
        peaks = []
        for grains in (None, _api.Grains()):
            tracemalloc.start()
            _api.map_(run, "activations", "abs_max", start=0, stop=span, width=1000, grains=grains)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        kept = _api.Grains().get(run, "activations", 0, rows[:span], span // GRAIN).nbytes
        print(f"  memory over {span} steps: a map answer read from the rows (no cache), peak "
              f"{peaks[0] / 1e6:.1f} MB; as the server answers it (grains: the stored pyramid, "
              f"a new cache), peak {peaks[1] / 1e6:.1f} MB; the cache of maxima {kept / 1e6:.1f} MB")


def bench_tensorboard(loc: str, tb_steps: int, layers: int) -> None:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        print(f"tensorboard: skipped ({e})")
        return
    from tensortape.recorder import histogram
    _, hi = histogram.bin_edges()
    names = names_of(layers)
    tmp = tempfile.mkdtemp(prefix="tt-tb-")
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    w = SummaryWriter(tmp)
    edges = np.where(np.isinf(hi), np.finfo(np.float64).max, hi)
    for step in range(tb_steps):
        st, hist = rows(step, layers, rng)
        for i, name in enumerate(names):
            used = np.nonzero(hist[i])[0]
            a, b = int(used[0]), int(used[-1]) + 1
            w.add_histogram_raw(name, float(st["min"][i]), float(st["max"][i]), float(st["count"][i]),
                                0.0, 0.0, edges[a:b].tolist(), hist[i, a:b].tolist(), step)
            w.add_scalar(f"{name}/nan", float(st["nan"][i]), step)
    w.close()
    wrote = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    print(f"tensorboard: event file of {tb_steps} steps x {layers} layers, {size / 1e6:.0f} MB, "
          f"written in {wrote:.0f} s")
    for label, guidance in (("every histogram (size_guidance 0)", {"histograms": 0, "scalars": 0}),
                            ("its defaults (1 histogram a tag, reservoir-sampled)", None)):
        t = time.perf_counter()
        acc = EventAccumulator(tmp, size_guidance=guidance) if guidance else EventAccumulator(tmp)
        acc.Reload()
        load = time.perf_counter() - t
        kept = len(acc.Histograms(names[0]))
        print(f"  EventAccumulator, {label}: {load:.1f} s to load; {kept} of {tb_steps} steps kept "
              f"a tag")
    shutil.rmtree(tmp, ignore_errors=True)
    server, url = serve(loc)
    t = time.perf_counter()
    get(f"{url}/api/map?stat=abs_max&width=1000&start=0&stop={tb_steps}")
    print(f"  tensortape serve, the same {tb_steps} steps x {layers} layers as a map: "
          f"{(time.perf_counter() - t) * 1e3:.0f} ms (a new server's first answer)")
    server.shutdown()
    server.server_close()


def bench_paint(loc: str, times: int) -> None:
    """First paint in Chromium of a new server's page (see the module)."""
    from playwright.sync_api import sync_playwright
    took, clicks = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        for _ in range(times):
            proc, url = _serve_process(loc)
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1000})
                t = time.perf_counter()
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=120_000)
                took.append(time.perf_counter() - t)
                clicks.append(click_evolution(page, names_of(SPIKE_LAYER + 1)[SPIKE_LAYER]))
                page.close()
            finally:
                proc.terminate()
                proc.communicate(timeout=60)
        browser.close()
    print(f"chromium: first paint (page load to the map and scalars drawn), a new server each "
          f"time: {', '.join(f'{x * 1000:.0f} ms' for x in took)}")
    print(f"chromium: a click on the map's cell of {names_of(SPIKE_LAYER + 1)[SPIKE_LAYER]} at "
          f"step {SPIKE} until its evolution is drawn, the map's statistics / every statistic: "
          f"{', '.join(f'{a * 1000:.0f} / {b * 1000:.0f} ms' for a, b in clicks)}")


def click_evolution(page, layer: str) -> tuple[float, float]:
    """Seconds from a click on ``layer``'s map cell at step ``SPIKE`` until the page
    draws its evolution: the map's statistics (``#evolution``'s ``data-layer``), then
    every statistic (``data-complete``).  The row is scrolled into view first."""
    label = page.locator(f"#map-labels div[data-layer='{layer}']")
    label.scroll_into_view_if_needed()
    row, box = label.bounding_box(), page.locator("#map").bounding_box()
    col = page.evaluate(f"""() => {{ const m = document.getElementById('map');
        return [Number(m.dataset.first), Number(m.dataset.last)]; }}""")
    x = box["x"] + box["width"] * (SPIKE - col[0] + 0.5) / (col[1] - col[0] + 1)
    page.evaluate("() => { const e = document.getElementById('evolution'); "
                  "e.dataset.layer = ''; e.dataset.complete = ''; }")
    t = time.perf_counter()
    page.mouse.click(x, row["y"] + row["height"] / 2)
    page.wait_for_function("(l) => document.getElementById('evolution').dataset.layer === l",
                           arg=layer, timeout=120_000, polling=5)
    first = time.perf_counter() - t
    page.wait_for_function("(l) => (document.getElementById('evolution').dataset.complete || '')"
                           ".startsWith(l + '|')", arg=layer, timeout=120_000, polling=5)
    return first, time.perf_counter() - t


def _serve_process(loc: str):
    """``tensortape serve LOC`` as a user starts it; (process, url)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "tensortape", "serve", loc, "--port", "0",
                             "--no-browser"], cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=root))
    return proc, proc.stdout.readline().split(" at ")[1].strip()


def bench_live(folder: str, times: int) -> None:
    """How soon a committed step of a live run shows (see the module)."""
    import torch
    from tensortape import Recorder
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    loc = os.path.join(folder, "live.zarr")
    shutil.rmtree(loc, ignore_errors=True)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    api, drawn = [], []
    with Recorder(model, loc, tensors_every=None) as rec:
        def one(step):
            with rec.step(step):
                model(torch.randn(4, 16)).sum().backward()
            rec.flush()
            return time.perf_counter()

        one(0)
        proc, url = _serve_process(loc)
        pw = browser = page = None
        try:
            if sync_playwright is not None:
                pw = sync_playwright().start()
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium")
                page = browser.new_page(viewport={"width": 1300, "height": 1000})
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=120_000)
            for step in range(1, times + 1):
                t = one(step)
                while get(f"{url}/api/runs")[0]["steps"][-1] != step:
                    time.sleep(0.01)
                api.append(time.perf_counter() - t)
                if page is not None:
                    page.wait_for_function(
                        f"() => document.getElementById('map').dataset.last === '{step}'",
                        timeout=120_000, polling=20)
                    drawn.append(time.perf_counter() - t)
        finally:
            if browser is not None:
                browser.close()
                pw.stop()
            proc.terminate()
            proc.communicate(timeout=60)

    def say(xs):
        return f"median {statistics.median(xs) * 1000:.0f} ms, most {max(xs) * 1000:.0f} ms"
    print(f"live run, a committed step until /api/runs names it ({times} steps): {say(api)}")
    if drawn:
        print(f"live run, a committed step until the page draws it, no reload ({times} steps): "
              f"{say(drawn)}")
    else:
        print("live run: Playwright is not installed, the page's figure is not measured")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000, help="0: only --live")
    ap.add_argument("--layers", type=int, default=200, help="at least 118 (the spike's layer)")
    ap.add_argument("--out", default=None, help="folder for the store, kept and reused")
    ap.add_argument("--tb-steps", type=int, default=2000, help="steps in the TensorBoard file (0: none)")
    ap.add_argument("--paint", type=int, default=0, help="first paints in Chromium to time (0: none)")
    ap.add_argument("--live", type=int, default=0, help="live steps to follow (0: none)")
    args = ap.parse_args()
    if args.steps and (args.layers <= SPIKE_LAYER or args.steps <= NAN_STEP):
        ap.error(f"--layers must be over {SPIKE_LAYER} and --steps over {NAN_STEP} (the spike's "
                 f"layer and the NaN's step)")
    folder = args.out or tempfile.mkdtemp(prefix="tt-serve-")
    if args.live:
        bench_live(folder, args.live)
    if not args.steps:                         # --steps 0: the live figure alone
        return
    loc = os.path.join(folder, f"serve-{args.layers}x{args.steps}.zarr")
    if not os.path.exists(os.path.join(loc, "zarr.json")):
        shutil.rmtree(loc, ignore_errors=True)
        took = write(loc, args.steps, args.layers)
        print(f"store: {args.layers} layers x {args.steps} steps, statistics only, written in "
              f"{took:.0f} s")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(loc) for f in fs)
    print(f"store: {loc}, {size / 1e6:.0f} MB")
    if args.paint:
        bench_paint(loc, args.paint)
    bench_server(loc, args.steps, args.layers)
    if args.tb_steps:
        bench_tensorboard(loc, min(args.tb_steps, args.steps), args.layers)
    if not args.out:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
