#!/usr/bin/env bash
# The time-to-accuracy campaign of docs/TIME_TO_ACCURACY.md: every workload at coverage rates 1, 2 and 3, 2000
# steps, seeds 0 and 1 (0, 1 and 2 for the CNN), the variants of one launch interleaved in chunks of 50 steps.
#
# Run it on a quiet machine (nothing else running: the variants' clocks are compared), as root with iproute2 (the
# link is shaped with tc in a network namespace and calibrated to each coverage rate):
#
#     sudo benchmarks/run_tta_campaign.sh [OUT]          # results and plots in OUT (default benchmarks/results/tta)
#     python benchmarks/time_to_accuracy.py --docs docs/TIME_TO_ACCURACY.md --render OUT/tta_*.json
#
# Wall-clock estimate on a quiet 2-core host: steps x variants x seeds x DDP's step, DDP's step about the compute
# times (1 + the coverage rate); compute per step about 0.18 s for GPT-2 mini and 0.22 s for the CNN medium (from
# their eager steps on this host, scaled by GPT-2 tiny's measured 0.024 s), 0.02 s for the controls; the compressed
# peers run faster than DDP, deft's first step and compiles add minutes:
#   GPT-2 mini, 13 buckets:                 CR 1  ~2 h     CR 2  ~4 h     CR 3  ~5.5 h
#   CNN medium, 9 buckets, three seeds:     CR 1  ~3.5 h   CR 2  ~7.5 h   CR 3  ~10 h
#   controls (GPT-2 tiny, CNN small at CR 2, the variants of the previous runs):  ~1.2 h
#   in all about 34 hours; each command below can run on its own (one results file each). A smoke of the GPT-2
#   mini at 200 steps (five variants, one seed, a loaded host) took 30 minutes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/benchmarks/results/tta}"
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/tta-cache}"  # compiles count once per graph
TTA=(python "$ROOT/benchmarks/time_to_accuracy.py" --steps 2000 --eval-every 50 --chunk 50 --docs '' --out "$OUT")

# DDP's round-off spread (ddp-ulp) is a property of the workload and the seed, not of the link: measured at CR 1.
# The compression peers (fp16 hook, PowerSGD rank 2 with warm start) run where communication dominates.
AT_CR1=(ddp ddp-ulp ddp-compiled deft deft-sync)
AT_CR23=(ddp ddp-compiled ddp-fp16 ddp-powersgd deft deft-sync deft-compensated-delays)

# the multi-bucket GPT-2 (1.8 M parameters, AdamW): DDP's cap scaled to this model (13 buckets)
GPT2=(--workload gpt2 --size mini --buckets scaled --batch 8 --seeds 0 1)
"${TTA[@]}" "${GPT2[@]}" --coverage 1 --variants "${AT_CR1[@]}"
"${TTA[@]}" "${GPT2[@]}" --coverage 2 --variants "${AT_CR23[@]}"
"${TTA[@]}" "${GPT2[@]}" --coverage 3 --variants "${AT_CR23[@]}"

# the multi-bucket CNN (BatchNorm ResNet medium, 0.70 M parameters, SGD momentum): scaled caps (9 buckets); 30 % of
# labels random and 4096 validation images so that DDP's round-off spread resolves a 1 % target (measured within
# 1 % on the CNN small: docs/TIME_TO_ACCURACY.md; ddp-ulp at CR 1 measures the medium's)
CNN=(--workload cnn --size medium --buckets scaled --label-noise 0.3 --val-windows 4096 --batch 16 --seeds 0 1 2)
"${TTA[@]}" "${CNN[@]}" --coverage 1 --variants "${AT_CR1[@]}"
"${TTA[@]}" "${CNN[@]}" --coverage 2 --variants "${AT_CR23[@]}"
"${TTA[@]}" "${CNN[@]}" --coverage 3 --variants "${AT_CR23[@]}"

# the fast controls, as the previous runs ran them (one bucket each): the defaults against plain and compensated
# delays without the Preserver
CONTROLS=(ddp ddp-ulp deft deft-sync deft-averaged deft-delays deft-compensated-delays)
"${TTA[@]}" --workload gpt2 --size tiny --batch 16 --seeds 0 1 --coverage 2 --variants "${CONTROLS[@]}"
"${TTA[@]}" --workload cnn --size small --batch 16 --seeds 0 1 --coverage 2 --variants "${CONTROLS[@]}"
