"""The browser view in a real browser: Playwright drives Debian's chromium
(``apt-get install chromium``; Playwright's own browser download cannot reach
the internet here) against ``tensortape serve --port 0 --no-browser`` run as a
subprocess.  Skipped, with the reason, only where no chromium can be found."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from tensortape.analysis import first_divergence, open_run
from tensortape.recorder import Recorder

from test_serve import ROOT, XSS, record_spiky

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                               "(python3 -m pip install playwright pytest-playwright)")
CHROMIUM = next((p for p in (os.environ.get("TENSORTAPE_CHROMIUM"), shutil.which("chromium"),
                             "/usr/bin/chromium", shutil.which("chromium-browser"))
                 if p and os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium found (apt-get install "
                                "chromium, or set TENSORTAPE_CHROMIUM)")
NONFINITE_RGB = [0xff, 0x2d, 0x75]         # heat.js's colour of a non-finite cell


@pytest.fixture(scope="module")
def debian_chromium():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Server:
    def __init__(self, *runs):
        self.proc = subprocess.Popen([sys.executable, "-m", "tensortape", "serve", *runs, "--port", "0",
                                      "--no-browser"], cwd=ROOT, text=True,
                                     env=dict(os.environ, PYTHONPATH=ROOT),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline()
        assert " at http://" in line, line + self.proc.stderr.read()
        self.url = line.split(" at ")[1].strip()

    def close(self):
        self.proc.terminate()
        self.proc.communicate(timeout=300)


@pytest.fixture
def page(debian_chromium):
    """A page whose console errors, page errors and dialogs fail the test; and
    ``open(*runs)``, which serves them and loads the view."""
    pg = debian_chromium.new_page(viewport={"width": 1300, "height": 1000})
    problems, servers = [], []
    pg.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))

    def open_(*runs):
        servers.append(Server(*runs))
        pg.goto(servers[-1].url)
        pg.wait_for_selector("body[data-ready='1']", timeout=60000)
        return pg
    pg.open = open_
    yield pg
    pg.close()
    for s in servers:
        s.close()
    assert problems == []


def centre(box):
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def pixel(pg, x, y, canvas="map"):
    """The map canvas's colour at page point (x, y)."""
    return pg.evaluate("""([x, y, id]) => {
        const c = document.getElementById(id), r = c.getBoundingClientRect();
        const k = c.width / r.width;
        return Array.from(c.getContext('2d').getImageData((x - r.left) * k, (y - r.top) * k, 1, 1).data).slice(0, 3);
    }""", [x, y, canvas])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tensortape.sample_runs.task import record
    d = tmp_path_factory.mktemp("browser")
    return {"nan": record(str(d / "nan.zarr"), steps=16, diverge=True, log=lambda s: None),
            "ok": record(str(d / "ok.zarr"), steps=16, log=lambda s: None),
            "xss": record_spiky(str(d / "xss.zarr"), steps=40, spike=30, nan_step=None)}


def test_the_first_nan_is_named_and_marked_at_its_layer_and_step(page, runs):
    first = open_run(runs["nan"]).first_nonfinite()
    pg = page.open(runs["nan"])
    text = pg.inner_text("[data-testid=first-nonfinite]")
    assert f"step {first.step}" in text and first.layer in text
    pg.click("#jump")
    pg.wait_for_selector(f"[data-testid=histogram][data-step='{first.step}']")   # jumped
    mark = pg.wait_for_selector("[data-testid=first-nonfinite-cell]")
    assert (mark.get_attribute("data-layer"), mark.get_attribute("data-step")) == \
        (first.layer, str(first.step))
    x, y = centre(mark.bounding_box())
    label = pg.locator("#map-labels div", has_text=first.layer).first.bounding_box()
    assert label["y"] <= y <= label["y"] + label["height"]          # on the layer's row
    assert pixel(pg, x, y) == NONFINITE_RGB
    assert pg.inner_text("[data-testid=scalars] .caption") == "no scalars recorded"


def test_clicking_a_cell_shows_that_steps_histogram_with_its_nan_count(page, runs):
    run = open_run(runs["nan"])
    first = run.first_nonfinite()
    pg = page.open(runs["nan"])
    pg.select_option("#kind", first.kind)
    pg.wait_for_function("k => document.getElementById('map-title').textContent.includes(k)", arg=first.kind)
    pg.fill("#start", str(first.step - 3))
    pg.fill("#stop", str(first.step + 3))
    pg.click("#zoom")
    pg.wait_for_function("s => document.getElementById('map').dataset.first === s",
                         arg=str(first.step - 3))
    box = pg.locator(f"[data-testid=first-nonfinite-cell][data-step='{first.step}']").bounding_box()
    pg.mouse.click(*centre(box))
    pg.wait_for_selector(f"[data-testid=histogram][data-step='{first.step}']")
    want = run.histogram(first.layer, first.kind, step=first.step)
    caption = pg.inner_text("[data-testid=histogram] .caption")
    assert first.layer in caption and f"NaN {int(want.nan)}" in caption
    assert f"+Inf {int(want.posinf)}" in caption and f"-Inf {int(want.neginf)}" in caption
    # the evolution's charts (one canvas each) come from their own answer, after the histogram
    pg.wait_for_function("() => document.querySelectorAll('[data-testid=evolution] canvas').length >= 8")
    # a cell before the NaN: its own step, no NaN
    pg.mouse.click(                             # three columns to the left: step - 3
        box["x"] - box["width"] * 2.5, centre(box)[1])
    pg.wait_for_selector(f"[data-testid=histogram][data-step='{first.step - 3}']")
    assert "NaN 0 " in pg.inner_text("[data-testid=histogram] .caption")


def test_a_live_runs_new_steps_appear_without_a_reload(page, tmp_path):
    """The page follows a live run by itself (how soon, within 2 s, is bench_serve's
    figure: a timing is no unit test on a loaded machine)."""
    store, gate = str(tmp_path / "live.zarr"), tmp_path / "gate"
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {ROOT!r})
        from tensortape.recorder import Recorder
        from tests.test_serve import Spiky
        model, gate = Spiky(), {str(gate)!r}
        with Recorder(model, {store!r}, tensors_every=None, capture=("activations",),
                      flush_interval=0.2, stats_every=1) as rec:
            for step in range(10):
                if step == 5:
                    rec.flush(); open(gate + ".ready", "w").close()
                    while not os.path.exists(gate + ".more"): time.sleep(0.05)
                with rec.step(step), torch.no_grad():
                    model(torch.randn(3, 4))
            rec.flush(); open(gate + ".flushed", "w").close()
            while not os.path.exists(gate + ".stop"): time.sleep(0.05)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        for _ in range(1200):
            if os.path.exists(f"{gate}.ready"):
                break
            time.sleep(0.1)
        pg = page.open(store)
        assert pg.eval_on_selector("#map", "c => c.dataset.last") == "4"
        assert "recording" in pg.inner_text("[data-testid=status]")
        open(f"{gate}.more", "w").close()
        for _ in range(1200):
            if os.path.exists(f"{gate}.flushed"):
                break
            time.sleep(0.05)
        pg.wait_for_function("() => document.getElementById('map').dataset.last === '9'",
                             timeout=120_000)
        assert "steps 0–9" in pg.inner_text("[data-testid=status]")
    finally:
        open(f"{gate}.stop", "w").close()
        child.wait(timeout=120)
    pg.wait_for_function("() => document.getElementById('status').textContent.includes('complete')",
                         timeout=10000)


def test_compare_marks_the_first_divergence(page, runs):
    step, layer = first_divergence(runs["ok"], runs["nan"], kinds=["activations"])
    pg = page.open(runs["ok"], runs["nan"])
    pg.wait_for_selector("[data-testid=compare-map]")     # whole: no redraw under the asserts
    pg.wait_for_function("() => document.getElementById('compare').dataset.pending === ''",
                         timeout=60000)
    text = pg.inner_text("[data-testid=first-divergence]")
    assert f"step {step}" in text and layer in text
    mark = pg.wait_for_selector("[data-testid=first-divergence-cell]")
    assert (mark.get_attribute("data-layer"), mark.get_attribute("data-step")) == (layer, str(step))
    label = pg.locator("#compare-labels div", has_text=layer).first.bounding_box()
    y = centre(mark.bounding_box())[1]
    assert label["y"] <= y <= label["y"] + label["height"]
    assert layer in pg.inner_text("[data-testid=compare-evolution]")


def test_two_runs_map_answers_at_once_and_the_page_stays_usable_until_the_tensors_are_compared(
        page, runs):
    """Before: the two-run map came only with the whole comparison (every full tensor),
    and the page did nothing until then.  Now the first answer is the statistics'
    (``pending``: the full tensors' progress), the page paints it, answers clicks and asks
    again until the answer is whole.  The whole answer is held back here (the page sees
    it as still pending) until the test has clicked."""
    import json
    answers, hold = [], [True]

    def held(route):
        response = route.fetch()
        body = response.json()
        answers.append(body["pending"])
        if body["pending"] is None and hold[0]:
            body = dict(body, pending={"done": 0, "of": 1})
        route.fulfill(response=response, body=json.dumps(body))
    page.route("**/api/compare-map*", held)
    pg = page.open(runs["ok"], runs["nan"])
    pending = "() => document.getElementById('compare').dataset.pending"
    pg.wait_for_function(f"() => ({pending})()")
    assert answers[0] is not None and answers[0]["done"] == 0      # the server's first answer
    labels = pg.locator("#compare-labels div")
    layer = labels.nth(1).inner_text()
    row, box = labels.nth(1).bounding_box(), pg.locator("#compare-map").bounding_box()
    pg.mouse.click(box["x"] + box["width"] / 2, row["y"] + row["height"] / 2)
    pg.wait_for_function("(layer) => document.querySelector('[data-testid=compare-evolution] "
                         ".caption').textContent.startsWith(layer + ' (')", arg=layer)
    assert pg.evaluate(pending) and "comparing the full tensors" in pg.inner_text(
        "[data-testid=first-divergence]")
    hold[0] = False
    pg.wait_for_function(f"() => ({pending})() === ''", timeout=60000)
    step, first = first_divergence(runs["ok"], runs["nan"], kinds=["activations"])
    text = pg.inner_text("[data-testid=first-divergence]")
    assert f"step {step}, layer {first}" in text and "comparing" not in text


def test_two_runs_unlike_in_shape_name_the_layer_left_out(page, tmp_path):
    """Before: the answer's ``unlike`` was not shown, and a layer the runs hold in other
    shapes vanished from the map without a word.  Now one line names it and both shapes,
    as plain forward hooks saw them."""
    from test_serve_compare import record as record_shaped
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    seen_a, seen_b = record_shaped(a, (24,), None), record_shaped(b, (4, 6), None)
    pg = page.open(a, b)
    pg.wait_for_function("() => document.getElementById('compare').dataset.pending === ''",
                         timeout=60000)
    line = pg.locator("[data-testid=compare-unlike]")
    assert line.is_visible()
    assert f"view: shapes {tuple(seen_a['view', 0].shape)} and {tuple(seen_b['view', 0].shape)}" \
        in line.inner_text()
    assert pg.locator("#compare-labels div").all_inner_texts() == ["lin"]


def test_a_layer_named_like_html_is_shown_as_text(page, runs):
    pg = page.open(runs["xss"])
    assert pg.locator("#map-labels div", has_text=XSS).count() == 1
    assert pg.locator("img").count() == 0
    assert pg.inner_text("[data-testid=scalars] .caption") == "2 scalars over 6 steps"
    assert pg.locator("[data-testid=scalars] canvas").count() == 2      # loss and lr


def test_layers_filter_by_glob_sort_by_peak_and_a_hover_shows_the_stored_value(page, runs):
    import json
    import urllib.request
    pg = page.open(runs["ok"])
    with urllib.request.urlopen(pg.url.split("?")[0].rstrip("/") + "/api/map?stat=abs_max&width=1000") as r:
        m = json.loads(r.read())
    pg.fill("#filter", "encoder.layers.0.*")
    labels = pg.locator("#map-labels div").all_inner_texts()
    assert labels == [n for n in m["layers"] if n.startswith("encoder.layers.0.")]
    pg.fill("#filter", "")
    pg.select_option("#sort", "peak")
    peaks = {n: max(v) for n, v in zip(m["layers"], m["values"])}
    assert pg.locator("#map-labels div").all_inner_texts() == sorted(peaks, key=lambda n: -peaks[n])
    top = max(peaks, key=peaks.get)                  # the first row now; hover its last column
    box = pg.locator("#map").bounding_box()
    pg.mouse.move(box["x"] + box["width"] - 1, box["y"] + 2)
    text = pg.inner_text("#tooltip")
    lines = text.splitlines()
    assert lines[0] == top and lines[1] == f"step {m['step_lo'][-1]}"
    assert float(lines[2].split(" = ")[1]) == m["values"][m["layers"].index(top)][-1]


BLOWUP, BAD = 40, 17                  # a 40-step run; at step 17 values near 4e37 and a NaN


def record_blowup(path: str) -> str:
    """Spiky's layers; at step BAD the input is ~4e37 (past 1.8e19: the histograms'
    open-ended tail bins) with one NaN; the loss logged is finite, then inf, then NaN."""
    return record_spiky(path, steps=BLOWUP, spike=BAD, nan_step=BAD, scale=4e37, scalars=lambda step, out: {
        "loss": 1.0 / (1 + step) if step < BAD else float("inf") if step == BAD else float("nan")})


@pytest.fixture(scope="module")
def blowup(tmp_path_factory):
    return record_blowup(str(tmp_path_factory.mktemp("browser") / "blowup.zarr"))


def test_jump_shows_every_step_and_no_infinite_or_stray_tick(page, blowup):
    import json
    first = open_run(blowup).first_nonfinite()
    assert first.step == BAD
    pg = page.open(blowup)
    pg.click("#jump")
    pg.wait_for_selector(f"[data-testid=histogram][data-step='{BAD}']")
    title = pg.inner_text("#map-title")
    assert f"steps 0–{BLOWUP - 1} ({BLOWUP} steps" in title, title
    shown = [pg.input_value(f"#{i}") or pg.get_attribute(f"#{i}", "placeholder") for i in ("start", "stop")]
    assert shown == ["0", str(BLOWUP - 1)]                # the fields say what the title says
    ticks = json.loads(pg.get_attribute("[data-testid=histogram] .chart", "data-ticks"))
    assert ticks and not any("Infinity" in t or "NaN" in t for t in ticks), ticks
    pg.wait_for_selector("[data-testid=evolution][data-complete]")
    ys = json.loads(pg.get_attribute("[data-testid=evolution] [data-stat=min]", "data-yticks"))
    v = [float(t) for t in ys]
    gap = v[1] - v[0]                                     # evenly spaced, 0 where 0 is meant
    assert all(abs((b - a) - gap) <= 1e-6 * abs(gap) for a, b in zip(v, v[1:])), ys
    assert all(t == "0" for t, x in zip(ys, v) if abs(x) < gap / 2), ys
    # the user's axis: a min of -3.4e38 over data near 0 (a running sum of ticks gave -3.8e22)
    got = pg.evaluate("() => Heat.ticks(-3.4e38, -0.5, 4).map(Heat.short)")
    assert got == ["-3.0e+38", "-2.0e+38", "-1.0e+38", "0"], got


def test_scalars_mark_their_non_finite_steps(page, blowup):
    pg = page.open(blowup)
    c = pg.locator("[data-testid=scalars] canvas").first            # loss, the one scalar
    pink = c.evaluate("""c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] > 240 && d[i + 1] < 80 && d[i + 2] > 90 && d[i + 2] < 150) n++;
        return n; }""")
    assert pink > 50                                      # a pink dotted line at each of steps 17-39
    assert "non-finite values logged" in pg.inner_text("[data-testid=scalars] .caption")


def test_two_runs_nan_against_nan_is_drawn_non_finite_and_each_runs_first_named(page, runs):
    first = open_run(runs["nan"]).first_nonfinite()
    pg = page.open(runs["nan"], runs["nan"])
    text = pg.inner_text("[data-testid=first-nonfinite]")
    assert f"A: {runs['nan']}" in text and f"B: {runs['nan']}" in text
    assert text.count(f"step {first.step}, layer {first.layer}") == 2
    legend = pg.inner_text("#compare-legend")
    assert "small difference" in legend and "large difference" in legend and "zero" not in legend
    pg.select_option("#kind", first.kind)
    pg.wait_for_function("k => document.getElementById('first-divergence').textContent.includes(k)", arg=first.kind)
    label = pg.locator("#compare-labels div", has_text=first.layer).first.bounding_box()
    box = pg.locator("#compare-map").bounding_box()
    # the column of first.step: the map's columns are its steps, one a column (16 steps)
    steps = open_run(runs["nan"]).steps(first.kind)
    col = list(steps).index(first.step)
    x = box["x"] + (col + 0.5) * box["width"] / len(steps)
    assert pixel(pg, x, label["y"] + label["height"] / 2, "compare-map") == NONFINITE_RGB


# --- what the page draws, against the samples; its link; its labels ---------------------------------
@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    from test_views import record_embedding
    return record_embedding(str(tmp_path_factory.mktemp("browser") / "embed.zarr"))


def drawn_pixel(pg, selector, x, y):
    """The colour at (x, y) of the canvas uPlot drew in ``selector`` (x, y in its plot's
    data: ``u.valToPos``)."""
    return pg.evaluate("""([sel, x, y]) => {
        const c = document.querySelector(sel + ' canvas'), u = document.querySelector(sel)._u;
        const px = u.valToPos(x, 'x', true), py = u.valToPos(y, 'y', true);
        const d = c.getContext('2d').getImageData(px, py, 1, 1).data;
        return d[3] === 0 ? [255, 255, 255] : Array.from(d).slice(0, 3);     // transparent: the page
    }""", [selector, x, y])


def test_a_gaussian_is_one_bell_of_densities_on_a_linear_axis_as_the_png(page, embedding):
    """An embedding's output, N(0, 0.028): the page's bars are the PNG's (density per unit
    of value), ticks are values evenly spaced (no -4.7e-9 beside -1.7e-16), and the bell
    is drawn: filled at its top, white beside it at that height."""
    import json
    from test_views import png_bars, samples
    pg = page.open(embedding)
    pg.goto(pg.url.split("?")[0] + "?layer=embed&step=3")          # a link to that cell
    pg.wait_for_selector("[data-testid=histogram][data-step='3']")
    bars = json.loads(pg.get_attribute("[data-testid=histogram] .chart", "data-bars"))
    lo, hi, height = (np.array([float(v) for v in bars[k]]) for k in ("lo", "hi", "height"))
    png = png_bars(open_run(embedding), 3, "linear")
    np.testing.assert_array_equal(lo, png[0])
    np.testing.assert_allclose(height, png[2], rtol=1e-12)
    x = samples(3).astype(float)
    count = ((x[:, None] >= lo) & (x[:, None] < hi)).sum(axis=0)
    np.testing.assert_allclose(height[:-1], (count / (x.size * (hi - lo)))[:-1], rtol=1e-12)
    ticks = [float(t) for t in json.loads(pg.get_attribute("[data-testid=histogram] .chart", "data-ticks"))]
    gaps = np.diff(ticks)
    assert len(ticks) >= 4 and np.allclose(gaps, gaps[0], rtol=1e-9), ticks
    assert all(t == 0 or abs(t) >= 1e-3 for t in ticks), ticks
    top = int(np.argmax(height))
    centre = (lo[top] + hi[top]) / 2
    assert abs(centre) < 0.02
    blue = drawn_pixel(pg, "[data-testid=histogram] .chart", centre, height[top] / 2)
    white = drawn_pixel(pg, "[data-testid=histogram] .chart", 0.09, height[top] / 2)
    assert blue[2] > 200 and blue[0] < 200 and white == [255, 255, 255], (blue, white)
    assert "per unit of value" in pg.inner_text("[data-testid=histogram]")
    pg.select_option("#scale", "symlog")
    pg.wait_for_selector("[data-testid=histogram][data-scale=symlog]")
    assert "per decade" in pg.inner_text("[data-testid=histogram]")
    assert "0" in json.loads(pg.get_attribute("[data-testid=histogram] .chart", "data-ticks"))


def test_a_link_restores_the_view_runs_kind_statistic_filter_zoom_and_cell(page, runs):
    first = open_run(runs["nan"]).first_nonfinite()
    pg = page.open(runs["nan"])
    pg.select_option("#kind", first.kind)
    pg.select_option("#stat", "std")
    pg.wait_for_function("() => document.getElementById('map-title').textContent.startsWith('std of')")
    pg.fill("#filter", "encoder.*")
    pg.fill("#start", "2")
    pg.fill("#stop", "12")
    pg.click("#zoom")
    pg.wait_for_function("() => document.getElementById('map').dataset.first === '2'")
    box = pg.locator(f"[data-testid=first-nonfinite-cell][data-step='{first.step}']").bounding_box()
    pg.mouse.click(*centre(box))
    pg.wait_for_selector(f"[data-testid=histogram][data-step='{first.step}']")
    pg.select_option("#scale", "symlog")
    link = pg.url
    other = page.context.browser.new_page(viewport={"width": 1300, "height": 1000})
    try:
        other.goto(link)
        other.wait_for_selector("body[data-ready='1']", timeout=60000)
        other.wait_for_selector(f"[data-testid=histogram][data-step='{first.step}']")
        assert other.input_value("#kind") == first.kind and other.input_value("#stat") == "std"
        assert other.input_value("#filter") == "encoder.*" and other.input_value("#scale") == "symlog"
        assert other.eval_on_selector("#map", "c => [c.dataset.first, c.dataset.last]") == ["2", "12"]
        assert other.get_attribute("[data-testid=histogram]", "data-layer") == first.layer
        labels = other.locator("#map-labels div").all_inner_texts()
        assert labels and all(t.startswith("encoder.") for t in labels)
        mark = other.locator("[data-testid=selected-cell]")
        assert (mark.get_attribute("data-layer"), mark.get_attribute("data-step")) == (first.layer, str(first.step))
    finally:
        other.close()


def test_a_link_keeps_a_layer_name_with_a_lone_surrogate(page, tmp_path):
    """Before: the link wrote the selected layer through URLSearchParams, which turned a
    lone surrogate into U+FFFD: the link opened no layer (the server has none of that name).
    The names are compared in the page (a lone surrogate does not cross Playwright's JSON)."""
    model = torch.nn.Sequential()
    model.add_module("a\udc80", torch.nn.Linear(2, 2))
    model.add_module("b", torch.nn.Linear(2, 2))
    path = str(tmp_path / "surrogate.zarr")
    with Recorder(model, path, capture="activations", tensors_every=None) as rec:
        for step in range(4):
            with rec.step(step), torch.no_grad():
                model(torch.randn(3, 2))
    assert open_run(path).layers[0] == "a\udc80"
    pg = page.open(path)
    row = pg.locator("#map-labels div").first.bounding_box()
    box = pg.locator("#map").bounding_box()
    pg.mouse.click(box["x"] + box["width"] / 2, row["y"] + row["height"] / 2)
    named = "() => document.querySelector('[data-testid=histogram]').dataset.layer === 'a\\udc80'"
    pg.wait_for_function(named)
    link = pg.url
    other = page.context.browser.new_page(viewport={"width": 1300, "height": 1000})
    try:
        other.goto(link)
        other.wait_for_selector("body[data-ready='1']", timeout=60000)
        other.wait_for_function(named, timeout=20000)
        assert other.evaluate("() => document.querySelector('[data-testid=selected-cell]')"
                              ".dataset.layer === 'a\\udc80'")
    finally:
        other.close()


WIDE = 60                     # blocks of two layers: 120 rows


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """120 layers with Llama's names, 300 steps; a scalar logged each step, two once."""
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(torch.nn.ModuleDict(
                {"mlp": torch.nn.ModuleDict({"down_proj": torch.nn.Linear(4, 4)}),
                 "post_attention_layernorm": torch.nn.LayerNorm(4)}) for _ in range(WIDE))

        def forward(self, x):
            for b in self.model.layers:
                x = b["post_attention_layernorm"](b["mlp"]["down_proj"](x))
            return x
    model = Blocks()
    path = str(tmp_path_factory.mktemp("browser") / "wide.zarr")
    with Recorder(model, path, layers="model.layers.*.*", capture="activations",
                  tensors_every=None, stats_every=1) as rec:
        for step in range(300):
            with rec.step(step), torch.no_grad():
                model(torch.randn(2, 4))
                rec.log({"loss": 1.0 / (step + 1)})
        rec.log({"train_runtime": 12.5, "total_flos": 3.0e9})
    return path


def test_a_hundred_layers_keep_readable_labels_round_step_ticks_and_numbers_apart(page, wide):
    import re
    pg = page.open(wide)
    names = open_run(wide).layers
    labels = pg.locator("#map-labels div")
    assert labels.count() == 2 * WIDE
    for i in (0, 1, 77, 2 * WIDE - 1):
        d = labels.nth(i)
        name, text = d.get_attribute("title"), d.inner_text()
        assert name == names[i] and d.get_attribute("data-layer") == name      # full on hover
        assert d.bounding_box()["height"] >= 12 and d.is_visible()
        pattern = re.compile(".*".join(map(re.escape, text.split("…"))) + "$")
        assert pattern.match(name) and re.findall(r"\d+", text) == re.findall(r"\d+", name), text
    label = labels.nth(2 * WIDE - 1)                 # the last row: scrolled to, it shows
    label.scroll_into_view_if_needed()
    assert label.is_visible()
    ticks = [int(t) for t in pg.locator("#map-axis span").all_inner_texts()]
    assert len(ticks) >= 3
    k = ticks[1] - ticks[0]
    assert all(t % k == 0 for t in ticks) and str(k).strip("0") in ("1", "2", "5"), ticks
    # one-off values are a table, not charts of one point
    assert pg.locator("[data-testid=scalars] .chart").count() == 1
    rows = pg.locator("[data-testid=scalars] table.once tr").all_inner_texts()
    assert sorted(r.split()[0] for r in rows) == ["total_flos", "train_runtime"]
    assert "logged once" in pg.inner_text("[data-testid=scalars] .caption")
