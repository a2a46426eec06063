#!/usr/bin/env bash
# The measured study of the README ("Does a bigger, harder global batch retrieve better? The emoji study"):
# FastAP at global batch 32 / 128 / 512 / 2,048 at equal images seen, the hard vs the random sampler, and FastAP
# vs PNP-Dq vs Smooth-AP, each run on 2 gloo processes from configs/demo.yaml (EfficientNet-Lite0 with ImageNet
# weights, 64 px, frozen BatchNorm) for 12,288 training images (about 3.2 epochs of the 3,824 training images),
# evaluated on the 955 held-out classes halfway and at the end.
#
#   make study   (or: bash benchmarks/study.sh)   # about 25 minutes on 2 cores; outputs in runs/study/
#   OUT=/tmp/study PYTHON=.venv/bin/python bash benchmarks/study.sh
#
# Run again after an interruption: finished runs are skipped, the others continue from their checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/study}
SHARDS=${SHARDS:-runs/demo/emoji-shards}
if [ ! -f "$SHARDS/manifest.json" ]; then  # what `make demo` builds first (npm packages, offline after that)
  $PY -m ddp_rank.cli shards listing emoji "${HOME}/.cache/ddp_rank/emoji" "$(dirname "$SHARDS")/emoji.csv" --size 64
  $PY -m ddp_rank.cli shards build "$(dirname "$SHARDS")/emoji.csv" "$SHARDS" --overwrite --no-progress
fi
start=$(date +%s)
# 96 steps of 128 images = 12,288 images; --equal images scales the steps (and the intervals) to each batch size.
common=(--config configs/demo.yaml --processes 2 "data.shards=$SHARDS" train.steps=96 train.eval_every=48
        train.checkpoint_every=48 train.log_every=4 distributed.chunk_size=auto)
# 1. Batch size. The hard sampler draws a step from 2 categories, which cannot fill 2,048 images on this set
#    (`ddp-rank plan` says so), so this axis uses the random sampler.
$PY -m ddp_rank.cli sweep "${common[@]}" "train.output_dir=$OUT/batch" --equal images \
    data.sampler=random data.global_batch_size=32,128,512,2048
# 2. Sampler, at the demo's batch of 128.
$PY -m ddp_rank.cli sweep "${common[@]}" "train.output_dir=$OUT/sampler" data.sampler=hard,random
# 3. Loss, at 128 with the hard sampler (FastAP is the sampler sweep's hard run). PNP-Dq as in the PNP paper:
#    alpha 4, tau 0.01 (Smooth-AP takes tau and ignores alpha).
$PY -m ddp_rank.cli sweep "${common[@]}" "train.output_dir=$OUT/loss" data.sampler=hard loss.alpha=4 \
    loss.name=pnp,smoothap
end=$(date +%s)
$PY -m ddp_rank.cli compare "$OUT/batch" "$OUT/sampler" "$OUT/loss" --plot "$OUT/study.png" > "$OUT/study.md"
echo "wall time: $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s on $(nproc) cores, $(date -u +%F)" \
    | tee -a "$OUT/study.md"
cat "$OUT/study.md"
