#!/usr/bin/env bash
# A/B of source trees in one device call, where hosts differ more than a change does: each tree's
# single request and decode-step device time, the trees taken in turn, twice.
# Usage (on the GPU machine, from the repository root, .whl/ carried):
#   bash benchmarks/ab_trees.sh TREE [TREE...]     e.g. . .ab_base  (a tree: a folder holding nanofn/)
# A tree other than the checkout is a copy carried along, e.g. made here with
#   mkdir .ab_base && git archive HEAD | tar -x -C .ab_base   (and /.ab_base/ in .git/info/exclude)
# BATCHES (default "1 256"; "" for none) sets the decode batch sizes profiled; BENCH=N
# (default 0) first runs the standard workload N times a tree, the trees in turn; SHAPE
# (default qwen3-0.6b) is the --random-weights shape, e.g. SHAPE=qwen3-30b-a3b for a MoE
# change; FLAGS adds options to every run, e.g. FLAGS="--quantization=fp8
# --kv-cache-dtype=fp8" for an FP8 change. Each tree's nanofn is imported from PYTHONPATH;
# `python3 -m nanofn` would put the current folder first on sys.path and import the
# checkout's instead, so the workload runs from the tree's own folder. SINGLES (default 2)
# is the rounds of single requests (0: none, where a change cannot touch one sequence: an
# 8B shape's take a minute a tree); PROFILE_FLAGS adds options to the decode profiles, e.g.
# "--host-only --steps 30" (the step's time, without the device profile's kernel table).
set -u
shape=${SHAPE:-qwen3-0.6b}
python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 NANOFN_CACHE=/tmp/nanofn-cache
OUT=${OUT:-/tmp/nanofn-out}
mkdir -p "$OUT"
for round in $(seq 1 "${BENCH:-0}"); do
  for tree in "$@"; do
    log="$OUT/bench-$round-$(echo "$tree" | tr -c 'a-zA-Z0-9\n' _).txt"
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m nanofn bench \
      --random-weights "$shape" --max-model-len 4096 --profile ${FLAGS:-} > "$log" 2>&1)
    echo "$tree (bench $round): $(grep -E '^elapsed|^device busy' "$log" | tr '\n' ' ')"
  done
done
for round in $(seq 1 "${SINGLES:-2}"); do
  for tree in "$@"; do
    PYTHONPATH=/tmp/site:$(cd "$tree" && pwd) timeout 150 python3 benchmarks/single_request.py \
      --random-weights "$shape" ${FLAGS:-} 2>&1 | tail -1 | sed "s|^|$tree (round $round): |"
  done
done
for b in ${BATCHES-1 256}; do
  for tree in "$@"; do
    log="$OUT/profile-$b-$(echo "$tree" | tr -c 'a-zA-Z0-9\n' _).txt"
    PYTHONPATH=/tmp/site:$(cd "$tree" && pwd) timeout 150 python3 benchmarks/profile_decode.py \
      --random-weights "$shape" --batch "$b" ${FLAGS:-} ${PROFILE_FLAGS:-} > "$log" 2>&1
    grep "per decode step" "$log" | sed "s|^|$tree: |"
  done
done
