"""``tensortape serve``: its JSON API through HTTP against ``open_run`` (the expected
aggregates recomputed with numpy from ``run.stats``), its refusals, and its command."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XSS = "<img src=x onerror=alert(1)>"
STEPS, SPIKE, NAN_STEP = 1200, 1011, 733        # late one-step events in a run of 1,200 steps


class Spiky(nn.Module):
    """Three layers, the middle one named like an HTML tag."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.add_module(XSS, nn.Linear(8, 8))
        self.last = nn.Linear(8, 2)

    def forward(self, x):
        return self.last(torch.relu(getattr(self, XSS)(self.first(x))))


def _every_7th(step, out):
    return {"loss": out.square().mean(), "lr": 0.1 / (1 + step)} if step % 7 == 0 else None


def record_spiky(path: str, steps: int = STEPS, spike: int | None = SPIKE,
                 nan_step: int | None = NAN_STEP, scale: float = 1e6, scalars=_every_7th) -> str:
    """Statistics only; at ``spike`` the input is ``scale`` times larger, at ``nan_step``
    one input element is NaN (each for that one step); ``scalars(step, out)``: what
    to log at a step (None: nothing)."""
    model = Spiky()
    data = torch.Generator().manual_seed(1)
    with Recorder(model, path, tensors_every=None, capture=("activations",), stats_every=1) as rec:
        for step in range(steps):
            x = torch.randn(3, 4, generator=data)
            if step == spike:
                x = x * scale
            if step == nan_step:
                x[0, 0] = float("nan")
            with rec.step(step), torch.no_grad():
                out = model(x)
                if (logged := scalars(step, out)) is not None:
                    rec.log(logged)
    return path


@pytest.fixture(scope="module")
def spiky(tmp_path_factory):
    return record_spiky(str(tmp_path_factory.mktemp("serve") / "spiky.zarr"))


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    from tensortape.sample_runs.task import record
    out = str(tmp_path_factory.mktemp("serve") / "nan.zarr")
    return record(out, steps=16, diverge=True, log=lambda s: None)


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    from tensortape.sample_runs.task import record
    out = str(tmp_path_factory.mktemp("serve") / "ok.zarr")
    return record(out, steps=16, log=lambda s: None)


class Served:
    """A server of ``paths`` on a free loopback port, in a thread; ``get`` answers
    (status, JSON body)."""

    def __init__(self, *paths):
        from tensortape.analysis.browser._serve import make_server
        self.server = make_server(list(paths), "127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def raw(self, path: str) -> tuple[int, bytes, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=300) as r:
                return r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("Content-Type", "")

    def get(self, route: str, **query):
        # a lone surrogate of a name as its UTF-8 bytes, as the page sends it
        q = urllib.parse.urlencode(query, encoding="utf-8", errors="surrogatepass")
        status, body, _ = self.raw(f"/api/{route}?{q}")
        # strict JSON: a NaN or Infinity literal fails the test
        return status, json.loads(body, parse_constant=lambda c: pytest.fail(f"JSON holds {c}"))

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def whole(served: Served, **query) -> dict:
    """The compare map once its comparison is whole (``pending`` None), asked for again
    as the page asks (a full tensors' metric has no value until then)."""
    for _ in range(3000):
        status, m = served.get("compare-map", **query)
        assert status == 200, m
        if m["pending"] is None:
            return m
        threading.Event().wait(0.1)
    pytest.fail("the comparison never became whole")


@pytest.fixture
def serve():
    made = []

    def start(*paths):
        made.append(Served(*paths))
        return made[-1]
    yield start
    for s in made:
        s.close()


def as_float(v):
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v, v) if isinstance(v, str) else v


def expected_map(run, kind, stat, lo, hi):
    """Per layer (execution order) and column [lo[c], hi[c]]: the largest finite value
    of ``stat`` over those steps (NaN if none), and whether any is non-finite."""
    ds = run.stats(kind).compute()
    order = [n for n in run.layers if n in ds.layer.values]
    steps = ds.step.values
    bad = (ds["nan"] + ds["posinf"] + ds["neginf"]).values > 0
    if stat == "rms":
        finite = (ds["count"] - ds["nan"] - ds["posinf"] - ds["neginf"]).values
        vals = ds["norm"].values / np.sqrt(np.where(finite > 0, finite, np.nan))
    elif stat == "nonfinite":
        vals = (ds["nan"] + ds["posinf"] + ds["neginf"]).values.astype(float)
    else:
        vals = ds[stat].values
    cols = [(steps >= a) & (steps <= b) for a, b in zip(lo, hi)]
    j = [list(ds.layer.values).index(n) for n in order]
    values = np.array([[np.nanmax(vals[c, i]) if np.isfinite(vals[c, i]).any() else np.nan
                        for c in cols] for i in j])
    nonfinite = np.array([[bool(bad[c, i].any()) for c in cols] for i in j])
    return order, values, nonfinite


def check_partition(m, steps):
    """The columns cover the window's steps in order, each step once."""
    covered = []
    for a, b in zip(m["step_lo"], m["step_hi"]):
        covered += [int(s) for s in steps if a <= s <= b]
    assert covered == [int(s) for s in steps]


# --- the map -----------------------------------------------------------------------------
@pytest.mark.parametrize("stat", ["abs_max", "std", "norm", "rms", "nonfinite"])
@pytest.mark.parametrize("width, start, stop", [(1000, None, None), (200, None, None),
                                                (50, None, None), (7, None, None), (3, 100, 1100),
                                                (40, 130, 1000), (4, 700, 1200)])
def test_map_columns_are_the_largest_of_their_steps_never_a_sample(spiky, serve, stat, width,
                                                                   start, stop):
    s = serve(spiky)
    run = open_run(spiky)
    window = {k: v for k, v in (("start", start), ("stop", stop)) if v is not None}
    for _ in range(2):                  # the second answer from the server's cache of maxima
        status, m = s.get("map", kind="activations", stat=stat, width=width, **window)
        assert status == 200
        steps = run.steps("activations")
        steps = steps[(steps >= (start or 0)) & (steps < (stop or STEPS))]
        assert 0 < len(m["step_lo"]) <= width and m["steps_in_window"] == len(steps)
        check_partition(m, steps)
        order, values, nonfinite = expected_map(run, "activations", stat, m["step_lo"], m["step_hi"])
        assert m["layers"] == order
        got = np.array([[as_float(v) for v in row] for row in m["values"]], dtype=float)
        np.testing.assert_array_equal(got, values)          # bit-exact: JSON carries repr
        assert np.array(m["nonfinite"]).tolist() == nonfinite.tolist()


def test_a_one_step_spike_and_nan_late_in_the_run_survive_aggregation(spiky, serve):
    s = serve(spiky)
    run = open_run(spiky)
    ds = run.stats("activations").compute()
    _, m = s.get("map", stat="abs_max", width=7)
    row = m["layers"].index("first")
    spike_col = next(c for c, (a, b) in enumerate(zip(m["step_lo"], m["step_hi"])) if a <= SPIKE <= b)
    peak = float(ds["abs_max"].sel(layer="first", step=SPIKE))
    assert peak > 1e5 and m["values"][row][spike_col] == peak
    assert max(as_float(v) for v in m["values"][row]) == peak
    nan_col = next(c for c, (a, b) in enumerate(zip(m["step_lo"], m["step_hi"])) if a <= NAN_STEP <= b)
    assert [c for c, bad in enumerate(m["nonfinite"][row]) if bad] == [nan_col]


def test_a_zoom_reads_its_window_at_one_step_a_column(spiky, serve):
    s = serve(spiky)
    run = open_run(spiky)
    _, m = s.get("map", stat="std", start=SPIKE - 5, stop=SPIKE + 5, width=1000)
    assert m["step_lo"] == m["step_hi"] == list(range(SPIKE - 5, SPIKE + 5))
    std = run.stats("activations").compute()["std"]
    for i, layer in enumerate(m["layers"]):
        assert m["values"][i] == std.sel(layer=layer, step=slice(SPIKE - 5, SPIKE + 4)).values.tolist()


def test_the_diverged_run_marks_its_first_nonfinite_event(diverged, serve):
    s = serve(diverged)
    run = open_run(diverged)
    _, runs = s.get("runs")
    first = run.first_nonfinite()
    got = runs[0]["first_nonfinite"]
    assert (got["step"], got["layer"], got["kind"], got["nan"], got["posinf"], got["neginf"]) == \
        (first.step, first.layer, first.kind, first.nan, first.posinf, first.neginf)
    assert runs[0]["status"] == run.status and runs[0]["layers"] == run.layers
    assert runs[0]["kinds"] == run.kinds and runs[0]["ranks"] == run.ranks
    steps = run.steps("activations")
    assert runs[0]["steps"] == [int(steps[0]), int(steps[-1])]
    _, m = s.get("map", kind=first.kind, stat="nonfinite", width=1000)
    row = m["layers"].index(first.layer)
    assert m["nonfinite"][row][m["step_lo"].index(first.step)]
    assert not any(m["nonfinite"][row][:m["step_lo"].index(first.step)])


def test_histogram_and_stats_are_the_runs_own_numbers(diverged, serve):
    s = serve(diverged)
    run = open_run(diverged)
    first = run.first_nonfinite()
    _, h = s.get("histogram", layer=first.layer, kind=first.kind, step=first.step)
    want = run.histogram(first.layer, first.kind, step=first.step).compute()
    counts = want.values
    a = h["first_bin"]
    assert h["counts"] == counts[a:a + len(h["counts"])].tolist()
    assert sum(h["counts"]) == counts.sum()                      # nothing outside the span
    assert [as_float(v) for v in h["bin_lo"]] == want.bin_lo.values[a:a + len(h["counts"])].tolist()
    assert (h["nan"], h["posinf"], h["neginf"]) == (first.nan, first.posinf, first.neginf)
    assert all(isinstance(c, int) for c in h["counts"])
    _, st = s.get("stats", layer=first.layer, kind=first.kind)
    ds = run.stats(first.kind, layers=[first.layer]).isel(layer=0).compute()
    assert st["step"] == ds.step.values.tolist()
    for k in ("mean", "std", "abs_max", "norm", "zero_frac"):
        assert [as_float(v) for v in st[k]] == pytest.approx(ds[k].values.tolist(), nan_ok=True, rel=0, abs=0)
    for k in ("count", "nan", "posinf", "neginf"):
        assert st[k] == ds[k].values.tolist() and all(isinstance(v, int) for v in st[k])


def test_scalars_answer_empty_for_a_run_without_them(diverged, serve):
    s = serve(diverged)
    status, sc = s.get("scalars")
    assert status == 200 and sc == {"step": [], "values": {}, "nonfinite": {}, "series": {},
                                    "once": []}


def test_scalars_are_the_runs_logged_values(spiky, serve):
    s = serve(spiky)
    status, sc = s.get("scalars")
    ds = open_run(spiky).scalars()
    assert status == 200 and sc["step"] == list(range(0, STEPS, 7)) == ds.step.values.tolist()
    assert sc["values"]["lr"] == [0.1 / (1 + step) for step in sc["step"]]          # bit-exact
    assert sc["values"]["loss"] == ds["loss"].values.tolist()


def test_compare_map_marks_the_first_divergence(diverged, stable, serve):
    from tensortape.analysis import compare_runs, first_divergence
    s = serve(stable, diverged)
    _, c = s.get("compare-map", kind="activations", width=1000)
    assert c["first_divergence"] is not None
    step, layer = first_divergence(stable, diverged, kinds=["activations"])
    assert c["first_divergence"] == {"step": step, "layer": layer}
    ds = compare_runs(stable, diverged, "activations")
    assert c["step_lo"] == ds.step.values.tolist()
    for i, name in enumerate(c["layers"]):
        want = np.abs(ds["stat_rel"].sel(layer=name).values)
        assert [as_float(v) for v in c["values"][i]] == pytest.approx(want.tolist(), nan_ok=True, rel=0)
        assert c["nonfinite"][i] == np.isinf(want).tolist()


def test_compare_map_marks_nan_against_nan_non_finite_not_identical(diverged, serve):
    """A run against itself: where it holds a NaN or an Inf, the difference is no
    number (stat_rel calls NaN against NaN 0): non-finite, infinitely different."""
    s = serve(diverged, diverged)
    st = open_run(diverged).stats("activations").compute()
    held = (st["nan"].clip(min=0) + st["posinf"].clip(min=0) + st["neginf"].clip(min=0)) > 0
    assert held.any()
    for metric in ("stat_rel", "delta_mean"):
        _, c = s.get("compare-map", kind="activations", metric=metric, width=1000)
        assert c["step_lo"] == st.step.values.tolist()
        for i, name in enumerate(c["layers"]):
            bad = held.sel(layer=name).values
            assert c["nonfinite"][i] == bad.tolist()
            assert [v == "inf" for v in c["values"][i]] == bad.tolist()
            if metric == "stat_rel":
                assert [as_float(v) for v in c["values"][i]] == [math.inf if b else 0.0 for b in bad]


def test_scalars_say_which_logged_values_are_non_finite(tmp_path, serve):
    """loss goes inf then NaN; lr is logged every other step only (its missing steps
    are NaN in the table, yet nothing non-finite was logged)."""
    model = nn.Linear(2, 2)
    path = str(tmp_path / "loss.zarr")
    losses = [1.0, 0.5, math.inf, math.nan, math.nan, 0.25]
    with Recorder(model, path, tensors_every=None, capture=("activations",), stats_every=1) as rec:
        for step, loss in enumerate(losses):
            with rec.step(step), torch.no_grad():
                model(torch.ones(1, 2))
                rec.log({"loss": loss, **({"lr": 0.1} if step % 2 == 0 else {})})
    _, sc = serve(path).get("scalars")
    assert sc["nonfinite"] == {"loss": [i for i, v in enumerate(losses) if not math.isfinite(v)],
                               "lr": []}
    assert math.isnan(as_float(sc["values"]["lr"][1]))                   # missing: NaN


@pytest.mark.parametrize("name", ["nonfinite", "values", "step"])
def test_a_scalar_keeps_its_values_whatever_its_name(tmp_path, serve, name):
    """Before: a scalar named ``nonfinite`` was overwritten by the answer's own
    ``nonfinite`` key, and its values were lost."""
    model = nn.Linear(2, 2)
    path = str(tmp_path / "names.zarr")
    logged = {name: [0.5, math.inf, -2.0], "loss": [math.nan, 1.0, 3.0]}
    with Recorder(model, path, tensors_every=None, capture=("activations",), stats_every=1) as rec:
        for step in range(3):
            with rec.step(step), torch.no_grad():
                model(torch.ones(1, 2))
                rec.log({k: v[step] for k, v in logged.items()})
    status, sc = serve(path).get("scalars")
    shown = {"step": "step'"}.get(name, name)       # run.scalars()' coordinate, renamed
    assert status == 200 and sc["step"] == [0, 1, 2]
    assert set(sc) == {"step", "values", "nonfinite", "series", "once"}
    assert sc["values"] == {shown: [0.5, "inf", -2.0], "loss": ["nan", 1.0, 3.0]}
    assert sc["nonfinite"] == {shown: [1], "loss": [0]}
    assert sc["series"] == {shown: {"step": [0, 1, 2], "value": [0.5, "inf", -2.0]},
                            "loss": {"step": [0, 1, 2], "value": ["nan", 1.0, 3.0]}}
    assert sc["once"] == []


# --- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("route, query", [
    ("map", {"run": 5}),
    ("map", {"kind": "weights"}),
    ("map", {"stat": "bogus"}),
    ("map", {"rank": 3}),
    ("histogram", {"layer": "nope", "step": 1}),
    ("histogram", {"layer": "first", "step": 99999}),
    ("stats", {"layer": "nope"}),
    ("compare-map", {}),
    ("nothing", {}),
])
def test_unknown_things_are_404_with_one_line_of_json(spiky, serve, route, query):
    s = serve(spiky)
    status, body = s.get(route, **query)
    assert status == 404
    assert set(body) == {"error"} and "\n" not in body["error"] and body["error"]


@pytest.mark.parametrize("route,query", [("map", {}), ("compare-map", {}),
                                         ("stats", {"layer": "first"})])
@pytest.mark.parametrize("width", [0, -3])
def test_a_width_of_no_columns_is_refused_not_quietly_one(spiky, serve, route, query, width):
    s = serve(spiky, spiky)
    status, body = s.get(route, width=width, **query)
    assert status == 400 and "width" in body["error"] and "\n" not in body["error"]


def test_a_query_that_is_not_utf8_is_the_asker_s_fault(spiky, serve):
    """A byte that is no UTF-8 (``%FF``) is a 400 naming the fix, not a server error;
    a lone surrogate of a name, sent as its UTF-8 bytes, is a name like any other."""
    import json
    s = serve(spiky)
    status, body, _ = s.raw("/api/stats?layer=%FF&kind=activations")
    assert status == 400 and "UTF-8" in json.loads(body)["error"]
    status, body = s.get("stats", layer="no\udfff", kind="activations")
    assert status == 404 and body["error"].startswith("no layer")


@pytest.mark.parametrize("metric", ["rel_l2", "max_abs"])
def test_a_full_tensor_metric_leaves_steps_without_tensors_uncompared(tmp_path, serve, metric):
    """Two identical runs, full tensors every 3rd step: those steps are 0 apart, the
    others not compared ("nan", as a map's cell with no value), never different."""
    import torch
    from tensortape.recorder import Recorder
    paths = []
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        paths.append(str(tmp_path / f"{name}.zarr"))
        with Recorder(model, paths[-1], tensors_every=3, capture=("activations",), stats_every=1) as rec:
            for step in range(10):
                with rec.step(step), torch.no_grad():
                    model(torch.full((2, 3), step / 10))
    m = whole(serve(*paths), metric=metric, width=10)
    assert m["step_lo"] == list(range(10))
    held = [step % 3 == 0 for step in range(10)]
    for row, bad in zip(m["values"], m["nonfinite"]):
        assert not any(bad)
        assert [v != "nan" for v in row] == held and all(v in (0, "nan") for v in row)


def test_the_run_counts_every_event_not_only_those_kept(tmp_path, serve):
    """More non-finite events than the attributes keep (1,000): the count is them all."""
    import torch
    from tensortape.recorder import Recorder
    path = str(tmp_path / "many.zarr")
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(20)])
    with Recorder(model, path, tensors_every=None, capture=("activations",), stats_every=1) as rec:
        for step in range(60):
            with rec.step(step), torch.no_grad():
                model(torch.full((1, 2), float("nan")))
    run = open_run(path)
    total = sum(run.state(r).events_total for r in run.ranks)
    assert total == 60 * 21 > len(run.events)                  # 20 layers and the root
    status, body = serve(path).get("runs")
    assert status == 200 and body[0]["events"] == total


@pytest.mark.parametrize("path", [
    "/../../../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/static/../_serve.py",
    "/app.js/../../_api.py", "/..%2f..%2fzarr.json", "/zarr.json", "/rank0/zarr.json",
    "/analysis/_serve.py", "//etc/passwd",
])
def test_no_path_outside_the_page_is_served(spiky, serve, path):
    s = serve(spiky)
    status, body, ctype = s.raw(path)
    assert status == 404 and ctype == "application/json"
    assert json.loads(body) == {"error": "not found"}


def test_the_page_is_self_contained(spiky, serve):
    """Every file the page loads is served from the package; the page's own code names
    no other site; the vendored uPlot is the one its fetch script recorded (sha256),
    fetches nothing, and names only its own home in its licence header."""
    import hashlib
    import re
    from tensortape.analysis.browser._serve import STATIC
    s = serve(spiky)
    status, page, ctype = s.raw("/")
    assert status == 200 and ctype.startswith("text/html")
    loaded = re.findall(r'(?:src|href)="(/[^"]*)"', page.decode())
    assert loaded and set(loaded) <= set(STATIC), loaded
    vendor = os.path.join(ROOT, "analysis", "browser", "static", "vendor")
    with open(os.path.join(vendor, "SHA256SUMS")) as f:
        sums = dict(reversed(line.split()) for line in f if not line.startswith("#"))
    for path in STATIC:
        status, body, _ = s.raw(path)
        assert status == 200, path
        text = body.decode()
        if path.startswith("/vendor/"):
            assert hashlib.sha256(body).hexdigest() == sums[path.rsplit("/", 1)[1]], path
            assert set(re.findall(r"https?://[^\s\"')]*", text)) <= {"https://github.com/leeoniya/uPlot"}
            assert not re.search(r"fetch\(|XMLHttpRequest|import\(|innerHTML|WebSocket", text), path
        else:
            assert "http://" not in text and "https://" not in text and "innerHTML" not in text, path


def test_a_layer_named_like_html_is_returned_as_data(spiky, serve):
    s = serve(spiky)
    _, runs = s.get("runs")
    assert XSS in runs[0]["layers"]
    _, m = s.get("map")
    assert XSS in m["layers"]
    status, st = s.get("stats", layer=XSS)
    assert status == 200 and st["layer"] == XSS


def test_serving_never_writes_into_the_store(spiky, serve):
    def snapshot():
        return sorted((os.path.relpath(os.path.join(d, f), spiky), os.stat(os.path.join(d, f)).st_mtime_ns)
                      for d, _, fs in os.walk(spiky) for f in fs)
    before = snapshot()
    s = serve(spiky)
    s.get("runs"), s.get("map"), s.get("histogram", layer="first", step=3), s.get("stats", layer="last")
    assert snapshot() == before


def _with_host(url: str, path: str, host: str | None) -> tuple[int, bytes]:
    """GET ``path`` from the server at ``url`` with this ``Host`` header (None: none)."""
    import http.client
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    try:
        c.putrequest("GET", path, skip_host=True)
        if host is not None:
            c.putheader("Host", host)
        c.endheaders()
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@pytest.mark.parametrize("path", ["/api/runs", "/api/map", "/", "/app.js"])
def test_a_page_of_another_site_rebound_to_loopback_is_refused(spiky, serve, path):
    """DNS rebinding: the browser sends the attacker's name as Host; only the server's
    own names are answered (any port), as Jupyter does."""
    s = serve(spiky)
    port = s.server.server_address[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                 f"localhost.evil.example:{port}", "[::2]", f"10.0.0.1:{port}"):
        status, body = _with_host(s.url, path, host)
        assert status == 403, (host, status)
        assert "DNS rebinding" in json.loads(body)["error"]
        assert b"spiky" not in body and b"first" not in body     # nothing of the run
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST", "[::1]",
                 f"[::1]:{port}", None):
        assert _with_host(s.url, path, host)[0] == 200, host


def test_a_server_bound_beyond_loopback_answers_any_host(spiky):
    from tensortape.analysis.browser._serve import make_server
    server = make_server([spiky], "0.0.0.0", 0, warm=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert _with_host(url, "/api/runs", "tensortape.lan:8765")[0] == 200
    finally:
        server.shutdown()
        server.server_close()


# --- the command ---------------------------------------------------------------------------------
def _ctrl_c_as_on_a_terminal():
    """In the child before it starts: SIGINT's default disposition, which Python then
    makes KeyboardInterrupt (a test run started in the background by a shell, as CI may
    start it, ignores SIGINT, and a child inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "tensortape", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_ctrl_c_as_on_a_terminal, **kw)


def test_serve_prints_its_url_answers_and_exits_0_on_ctrl_c(spiky):
    p = _cli("serve", spiky, "--port", "0", "--no-browser")
    try:
        line = p.stdout.readline()
        assert line.startswith(f"serving {spiky} at http://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        with urllib.request.urlopen(url + "api/runs", timeout=300) as r:
            assert json.loads(r.read())[0]["path"] == spiky
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=300) == 0
    finally:
        p.kill()
        p.communicate()


def test_an_unreadable_run_is_one_line_and_exit_2_before_serving(tmp_path):
    bad = tmp_path / "bad.zarr"
    bad.mkdir()
    (bad / "zarr.json").write_text("{not json")
    for path in (str(bad), str(tmp_path / "missing.zarr")):
        p = _cli("serve", path, "--port", "0", "--no-browser")
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and err.startswith("Error: ")
        assert "--port" not in err and "listen" not in err, err     # the run is at fault


def test_a_host_other_than_loopback_warns_of_no_authentication(spiky):
    p = _cli("serve", spiky, "--host", "0.0.0.0", "--port", "0", "--no-browser")
    try:
        assert p.stdout.readline().startswith(f"serving {spiky} at http://0.0.0.0:")
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)
    assert "no authentication" in err


def test_help_and_analysis_do_not_import_the_server_or_torch():
    code = ("import sys, analysis, cli\n"
            "try:\n    cli.main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'tensortape.analysis.browser._serve' not in sys.modules and 'http.server' not in sys.modules\n"
            "assert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--no-browser" in r.stdout
