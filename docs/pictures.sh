#!/usr/bin/env bash
# Regenerate the README's pictures: bash docs/pictures.sh (about 2 minutes on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tensortape demo "$tmp/demo.zarr" --diverge > /dev/null
tensortape plot "$tmp/demo.zarr" --layer 'encoder.*' --kind gradients --type evolution \
    --stat abs_max -o docs/evolution.png
tensortape demo "$tmp/stable.zarr" > /dev/null
tensortape plot "$tmp/stable.zarr" --layer encoder.layers.1.linear1 --kind gradients \
    --type distribution -o docs/distribution.png
tensortape plot "$tmp/demo.zarr" --layer encoder.layers.0.linear2 --kind gradients \
    --type histogram --step 10 --scale symlog -o docs/histogram.png   # tails over 30 decades
tensortape compare "$tmp/stable.zarr" "$tmp/demo.zarr" --kind gradients -o docs/compare.png \
    > /dev/null || true          # exit 1: the runs diverge, as they should
