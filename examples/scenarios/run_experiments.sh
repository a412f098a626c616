#!/bin/sh
# Re-run every experiment of docs/experiments.md and refresh its figures.
#   sh examples/scenarios/run_experiments.sh [OUT_DIR]      (default: out/experiments)
# Each line is the experiment's one command; figures are copied to docs/experiments/.
set -eu
OUT=${1:-out/experiments}
FIG=docs/experiments
SIM="python -m fastroute sim"
mkdir -p "$OUT" "$FIG"
$SIM compare examples/scenarios/oscillation.toml --out "$OUT/oscillation" --quiet
$SIM compare examples/scenarios/cache-affinity.toml \
  --policies round-robin,least-request,power-of-two,consistent-hash,cache-aware,weighted-hrw \
  --out "$OUT/cache-affinity" --quiet
$SIM compare examples/scenarios/overload.toml --out "$OUT/overload" --quiet
$SIM compare examples/scenarios/degraded.toml --out "$OUT/degraded" --quiet
$SIM compare examples/scenarios/retry-storm.toml --out "$OUT/retry-storm" --quiet
$SIM compare examples/scenarios/regional.toml --out "$OUT/regional" --quiet
$SIM compare examples/scenarios/herd.toml --out "$OUT/herd" --quiet
$SIM sweep examples/scenarios/pd-experiment.toml --out "$OUT/pd" --quiet
cp "$OUT/oscillation/p-controller/weights.png" "$FIG/oscillation-p-controller-weights.png"
cp "$OUT/oscillation/lp/weights.png" "$FIG/oscillation-lp-weights.png"
cp "$OUT/oscillation/p-controller/ttft.png" "$FIG/oscillation-p-controller-ttft.png"
cp "$OUT/cache-affinity/compare.png" "$FIG/cache-affinity-compare.png"
cp "$OUT/overload/no-shedding/ttft.png" "$FIG/overload-no-shedding-ttft.png"
cp "$OUT/overload/shedding/ttft.png" "$FIG/overload-shedding-ttft.png"
cp "$OUT/degraded/no-derating/ttft.png" "$FIG/degraded-no-derating-ttft.png"
cp "$OUT/degraded/derating/ttft.png" "$FIG/degraded-derating-ttft.png"
cp "$OUT/degraded/derating/weights.png" "$FIG/degraded-derating-weights.png"
cp "$OUT/regional/global-lp/weights.png" "$FIG/regional-lp-weights.png"
cp "$OUT/herd/greedy/ttft.png" "$FIG/herd-greedy-ttft.png"
cp "$OUT/pd/goodput.png" "$FIG/pd-goodput.png"
echo "results in $OUT, figures in $FIG"
