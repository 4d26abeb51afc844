#!/bin/sh
# Vendor uPlot (MIT), the browser view's line and bar charts, from the npm registry:
# `npm pack` fetches the package's tarball once, its sha256 is checked against the one
# recorded here, and the three files the page needs are copied beside this script.
# The page loads nothing from the network; these files ship as package data.
#
#   sh analysis/browser/static/vendor/fetch.sh        (to update: change VERSION and SHA256)
set -eu
VERSION=1.6.32
SHA256=4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
npm pack --silent "uplot@$VERSION" >/dev/null
TGZ=uplot-$VERSION.tgz
GOT=$(sha256sum "$TGZ" | cut -d' ' -f1)
if [ "$GOT" != "$SHA256" ]; then
    echo "uplot-$VERSION.tgz has sha256 $GOT, not the recorded $SHA256" >&2
    exit 1
fi
tar -xzf "$TGZ"
cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css "$HERE/"
cp package/LICENSE "$HERE/uPlot.LICENSE"
cd "$HERE"
{
    echo "# uPlot $VERSION, from the npm tarball uplot-$VERSION.tgz (sha256 $SHA256), by fetch.sh"
    sha256sum uPlot.iife.min.js uPlot.min.css uPlot.LICENSE
} > SHA256SUMS
echo "uPlot $VERSION vendored into $HERE"
