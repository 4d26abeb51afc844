"""``tensortape serve``: the browser view's HTTP server.

The standard library's ``http.server.ThreadingHTTPServer``: the view is a
handful of GET routes for one user on loopback, so a framework (Starlette with
uvicorn, aiohttp) would add two or three runtime dependencies and buy nothing
(no websockets: a live run is followed by polling every second).  The page,
its scripts and its styles are package data (``analysis/browser/static``, uPlot
vendored in ``static/vendor``), read once; a request can reach only those
files (``STATIC``) and ``/api/``: no path of a request is ever joined to a
folder.

Every run is opened read-only (``open_run``), and opened again (its
attributes only) at most every ``REOPEN_S``, when asked: when its root or a
rank's state changed (new commits of a live run, a rank that appeared, a job
resumed with ``mode="a"``, a run recorded anew at its path), the new one is
served and the caches of the old one are dropped (the two-run comparison is
followed instead: ``_comparison``).
"""

from __future__ import annotations

import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from tensortape.recorder.errors import RecorderError, StoreFormatError

from . import _api, _layerview
from .._run import open_run
from .._stats import Statistics

__all__ = ["Served", "allowed_host", "loopback", "make_server"]

JS, CSS = "text/javascript; charset=utf-8", "text/css; charset=utf-8"
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", JS),
          "/heat.js": ("heat.js", JS), "/charts.js": ("charts.js", JS),
          "/app.css": ("app.css", CSS),
          "/vendor/uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", JS),
          "/vendor/uPlot.min.css": ("vendor/uPlot.min.css", CSS)}
REOPEN_S = 0.5          # a run is opened again, to see whether it changed, at most this often


class Served:
    """The runs served: each opened once, and again whenever it changed."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self.lock = threading.Lock()        # one reader at a time (the run's caches)
        self.runs = [open_run(p) for p in self.paths]
        self.opened = [time.monotonic()] * len(self.runs)
        self.sizes: list[int | None] = [None] * len(self.runs)
        self.compared: dict = {}            # compare_map's cache (it follows a run that changed)
        self.grains = _api.Grains()         # the maps' cache of maxima per grain of rows

    def run(self, i: int):
        if not 0 <= i < len(self.runs):
            raise _api.NotFound(f"no run {i}; {len(self.runs)} served (run=0"
                                f"{' or run=1' if len(self.runs) > 1 else ''})")
        if time.monotonic() - self.opened[i] > REOPEN_S:
            self._reopen(i)
        return self.runs[i]

    def _reopen(self, i: int) -> None:
        """Open run ``i`` again; serve the new one if it changed.  A run that cannot be
        opened now (being recorded anew at its path) stays as it was until it can."""
        run = self.runs[i]
        try:
            fresh = open_run(self.paths[i])
        except RecorderError:
            fresh = run
        self.opened[i] = time.monotonic()
        if fresh.attrs == run.attrs and fresh.ranks == run.ranks \
                and all(fresh.state(r) == run.state(r) for r in run.ranks):
            return
        self.sizes[i] = None
        if fresh.attrs.get("created") != run.attrs.get("created"):    # another run now
            self.grains.forget(run.path)
        self.runs[i] = fresh

    def warm(self) -> None:
        """Fill the maps' cache of every run, kind and rank, a block at a time (the
        lock is let go between blocks, so requests are answered meanwhile)."""
        for i in range(len(self.runs)):
            for rank in self.runs[i].ranks:
                for kind in self.runs[i].kinds_of(rank):
                    while True:
                        with self.lock:
                            run = self.run(i)
                            _, rows, _ = Statistics(run.index).rows(kind, rank)
                            done = self.grains.filled(run, kind, rank, rows)
                            want = len(rows) // _api.GRAIN
                            if done >= want:
                                break
                            self.grains.get(run, kind, rank, rows,
                                            min(want, done + _api.BLOCK // _api.GRAIN))

    def size(self, i: int) -> int | None:
        if self.sizes[i] is None:
            try:
                self.sizes[i] = self.runs[i].disk_bytes()
            except OSError:
                return None
        return self.sizes[i]

    def all(self) -> list:
        return [(self.run(i), self.size(i)) for i in range(len(self.runs))]


def _arg(q: dict, name: str, cast=str, default=None):
    v = q.get(name)
    if v is None or v == [""]:
        return default
    try:
        return cast(v[0])
    except ValueError:
        raise _api.BadRequest(f"{name}={v[0]!r} is not "
                              f"{'an integer' if cast is int else 'a number'}") from None


def answer(served: Served, path: str, q: dict):
    """The JSON of an /api/ route (``q``: the query, as ``parse_qs`` gives it)."""
    kind = _arg(q, "kind", default="activations")
    rank = _arg(q, "rank", int)
    window = {"start": _arg(q, "start", int), "stop": _arg(q, "stop", int)}
    if path == "/api/runs":
        return _api.runs(served.all())
    if path == "/api/compare-map":
        if len(served.runs) < 2:
            raise _api.NotFound("one run is served; compare needs two (tensortape serve A B)")
        return _api.compare_map(served.run(0), served.run(1), kind,
                                _arg(q, "metric", default="stat_rel"), rank,
                                width=_arg(q, "width", int, 1000),
                                rtol=_arg(q, "rtol", float, 1e-3), cache=served.compared,
                                **window)
    run = served.run(_arg(q, "run", int, 0))
    if path == "/api/map":
        return _api.map_(run, kind, _arg(q, "stat", default="abs_max"), rank,
                         width=_arg(q, "width", int, 1000), grains=served.grains, **window)
    layer = _arg(q, "layer", default="")
    if path == "/api/histogram":
        return _layerview.histogram(run, layer, kind, _arg(q, "step", int), rank,
                                    scale=_arg(q, "scale", default="linear"))
    if path == "/api/distribution":
        return _layerview.distribution(run, layer, kind, rank, width=_arg(q, "width", int, 400),
                                       scale=_arg(q, "scale", default="linear"), **window)
    if path == "/api/stats":
        only = _arg(q, "stats")
        return _layerview.stats(run, layer, kind, rank, width=_arg(q, "width", int),
                                only=only.split(",") if only else None, grains=served.grains,
                                **window)
    if path == "/api/scalars":
        return _api.scalars(run, rank)
    raise _api.NotFound(f"no route {path!r}")


class Handler(BaseHTTPRequestHandler):
    served: Served
    static: dict[str, bytes]
    server_version = "tensortape"

    def log_message(self, format, *args):      # quiet: the terminal shows the URL only
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; img-src 'self' data:; object-src 'none'")
        self.end_headers()
        if self.command != "HEAD":
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):     # the page went away: fine
                pass

    def _json(self, status: int, obj) -> None:
        body = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
        self._send(status, body, "application/json")

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urlsplit(self.path)
        host = self.headers.get("Host")
        if not allowed_host(host, self.server.server_address[0]):
            return self._json(403, {"error": f"Host {host!r} is not this server's own name; "
                                             f"open the URL tensortape serve printed (a page "
                                             f"of another site is refused: DNS rebinding)"})
        if url.path in STATIC:
            name, ctype = STATIC[url.path]
            return self._send(200, self.static[name], ctype)
        if not url.path.startswith("/api/"):
            return self._json(404, {"error": "not found"})
        try:                          # a lone surrogate of a layer's name comes as its UTF-8 bytes
            query = parse_qs(url.query, errors="surrogatepass")
        except UnicodeDecodeError:
            return self._json(400, {"error": "the query is not UTF-8 (percent-encode its UTF-8 bytes)"})
        try:
            with self.served.lock:
                out = answer(self.served, url.path, query)
        except _api.BadRequest as e:
            return self._json(400, {"error": _line(e)})
        except StoreFormatError as e:   # a store damaged, or changed under a read: not the asker's
            return self._json(500, {"error": _line(e)})
        except RecorderError as e:      # NotFound, and an unknown layer, kind or rank of the run
            return self._json(404, {"error": _line(e)})
        except Exception as e:          # a store that changed under a read: say so, keep serving
            return self._json(500, {"error": f"{type(e).__name__}: {_line(e)}"})
        self._json(HTTPStatus.OK, out)


LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def allowed_host(header: str | None, bound: str) -> bool:
    """Whether a request whose ``Host`` is ``header`` may be answered by a server bound
    to ``bound``: on a loopback address, only when it names the bound address,
    ``localhost``, ``127.0.0.1`` or ``[::1]`` (any port), as Jupyter does: a page of
    another site whose name it rebinds to 127.0.0.1 sends its own name.  A server
    bound elsewhere was asked to be reached by any name (and warned of it)."""
    if not loopback(bound) or header is None:      # no Host: HTTP/1.0, never a browser
        return True
    name = header.strip().lower()
    name = name[:name.index("]") + 1] if name.startswith("[") and "]" in name \
        else name.rpartition(":")[0] if name.rpartition(":")[2].isdigit() else name
    own = f"[{bound}]" if ":" in bound else bound
    return name in LOCAL_NAMES or name == own.lower()


def loopback(address: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _line(e: Exception) -> str:
    text = str(e).splitlines()
    return text[0] if text else type(e).__name__


def make_server(paths: list[str], host: str = "127.0.0.1", port: int = 8765, warm: bool = True):
    """The server of ``paths`` (opened and checked first: every run's summary is read
    once, so an unreadable run raises here, before serving).  ``warm``: fill the
    maps' cache in a background thread from the start."""
    served = Served(paths)
    _api.runs(served.all())
    folder = resources.files(__package__) / "static"
    static = {name: folder.joinpath(*name.split("/")).read_bytes() for name, _ in STATIC.values()}
    handler = type("ServeHandler", (Handler,), {"served": served, "static": static})
    server = ThreadingHTTPServer((host, port), handler)
    if warm:
        threading.Thread(target=_warm, args=(served,), daemon=True, name="tensortape-warm").start()
    return server


def _warm(served: Served) -> None:
    try:
        served.warm()
    except Exception:           # a store that changed under it: the maps read it when asked
        pass
