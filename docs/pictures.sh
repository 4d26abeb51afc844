#!/usr/bin/env bash
# Regenerate the README's pictures: bash docs/pictures.sh (a few minutes on a CPU; the
# browser view's screenshots need Playwright and Debian's chromium at /usr/bin/chromium, the
# TensorBoard one `tensorboard`).
set -euo pipefail
docs="$(cd "$(dirname "$0")" && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"                     # the runs are named as a user names them: demo.zarr, stable.zarr
tensortape demo demo.zarr --diverge > /dev/null
tensortape plot demo.zarr --layer 'encoder.*' --kind gradients --type evolution \
    --stat abs_max -o "$docs/evolution.png"
tensortape demo stable.zarr > /dev/null
tensortape plot stable.zarr --layer encoder.layers.1.linear1 --kind gradients \
    --type distribution -o "$docs/distribution.png"
tensortape plot demo.zarr --layer encoder.layers.0.linear2 --kind gradients \
    --type histogram --step 10 --scale symlog -o "$docs/histogram.png"   # tails over 30 decades
tensortape compare stable.zarr demo.zarr --kind gradients -o "$docs/compare.png" \
    > /dev/null || true          # exit 1: the runs diverge, as they should
python3 "$docs/../sample_runs/sae.py" sae > /dev/null && cp sae/sae.png "$docs/sae.png"
# the browser view, as a user opens it: the two runs served from the folder above them, the
# diverged one shown, its first NaN jumped to (serve.png); the two-run part of the page, their
# difference map, once the full tensors are compared (serve-compare.png)
mkdir -p runs && cp -r stable.zarr runs/baseline.zarr && cp -r demo.zarr runs/diverged.zarr
python3 - runs/baseline.zarr runs/diverged.zarr "$docs" <<'EOF'
import subprocess, sys
from playwright.sync_api import sync_playwright
proc = subprocess.Popen([sys.executable, "-m", "tensortape", "serve", *sys.argv[1:3], "--port", "0",
                         "--no-browser"], stdout=subprocess.PIPE, text=True)
try:
    url = proc.stdout.readline().split(" at ")[1].strip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1180})
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']", timeout=120_000)
        page.select_option("#run", "1")
        page.wait_for_selector("#jump:not([hidden])", timeout=60_000)
        page.click("#jump")
        page.wait_for_selector("[data-testid=histogram][data-step]", timeout=60_000)
        page.wait_for_timeout(500)
        page.screenshot(path=f"{sys.argv[3]}/serve.png")
        page.wait_for_function("() => document.getElementById('compare').dataset.pending === ''",
                               timeout=120_000)
        page.locator("#compare").scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        page.locator("#compare").screenshot(path=f"{sys.argv[3]}/serve-compare.png")
        browser.close()
finally:
    proc.terminate()
    proc.communicate(timeout=60)
EOF
# TensorBoard on the same diverged run, exported (tensorboard.png): what it shows of the
# same NaN, beside the map (served on 127.0.0.1 as a user serves it, Chromium pointed at it)
tensortape export demo.zarr tb --format tensorboard > /dev/null
python3 - tb "$docs/tensorboard.png" <<'EOF'
import socket, subprocess, sys, time, urllib.request
from playwright.sync_api import sync_playwright
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
proc = subprocess.Popen(["tensorboard", "--logdir", sys.argv[1], "--host", "127.0.0.1", "--port",
                         str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    url = f"http://127.0.0.1:{port}/"
    for _ in range(240):
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(url + "#timeseries")
        page.wait_for_timeout(20_000)          # its cards load one by one
        page.screenshot(path=sys.argv[2])
        browser.close()
finally:
    proc.terminate()
    proc.wait(timeout=60)
EOF
