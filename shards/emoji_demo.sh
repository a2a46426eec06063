#!/usr/bin/env bash
# Build the emoji demo shards: npm pack (cached) -> listing CSV -> shards -> verify.
# Usage: shards/emoji_demo.sh [OUT_DIR] [CACHE_DIR]   (env PYTHON, SIZE, WORKERS override the defaults)
set -euo pipefail
OUT="${1:-data/emoji-shards}"
CACHE="${2:-${XDG_CACHE_HOME:-$HOME/.cache}/ddp_rank/emoji}"
PYTHON="${PYTHON:-python}"
SIZE="${SIZE:-64}"
WORKERS="${WORKERS:-$(nproc)}"
"$PYTHON" -m ddp_rank.cli shards listing emoji "$CACHE" "$CACHE/emoji-$SIZE.csv" --size "$SIZE" --workers "$WORKERS"
"$PYTHON" -m ddp_rank.cli shards build "$CACHE/emoji-$SIZE.csv" "$OUT" --workers "$WORKERS" --max-samples 500 \
    --overwrite --no-progress
"$PYTHON" -m ddp_rank.cli shards verify "$OUT" --workers "$WORKERS"
