#!/bin/bash
# Device side of `scripts/device/pack.sh f-theta`: joins the parts gathered in /tmp/x, checks the
# hash, and times f_θ training steps (the 270M config on the small capture) on CUDA with the
# build and, when it came along, the second one (a baseline, or the fused build), each with its
# steps replayed from recorded graphs and issued one by one (`[train] graph`; GRAPHS="true false"
# by default; a build without `[train] graph` ignores the setting: give it GRAPHS=true),
# alternated ROUNDS times (default 1). Output in $OUT: ft.tgz (each run's report.json and log,
# with the medians of its host phases printed).
source .xfer/unpack.sh
mkdir -p checkpoints && rm -rf checkpoints/drafter-gemma3-270m-v2 && mv $X/drafter checkpoints/drafter-gemma3-270m-v2
mkdir -p $X/out
# ROUNDS=N: the builds alternated N times (default 1).
for round in $(seq ${ROUNDS:-1}); do
for b in cuda alt; do
    [ -x $X/kakeya-$b ] || continue
    for g in ${GRAPHS:-true false}; do
    rm -rf /tmp/x/ft-run /tmp/x/ft-export
    sed "/^\[train\]/a graph = $g" $X/ft.toml > $X/ft-$g.toml
    # A build without the setting reads the unchanged config.
    [ "$g" = true ] && [ "${GRAPHS:-}" = true ] && cp $X/ft.toml $X/ft-$g.toml
    run=$b-graph-$g-$round
    echo "== kakeya-$b, graph $g, round $round"
    KAKEYA_LOG=kakeya_train=debug timeout 200 $X/kakeya-$b train f-theta --config $X/ft-$g.toml --device ${KAKEYA_DEVICE:-cuda} > $X/out/ft-$run.log 2>&1; echo "rc=$?"
    grep -v DEBUG $X/out/ft-$run.log | grep -E "recorded for replay|records no graphs" | head -3
    grep -v DEBUG $X/out/ft-$run.log | tail -1
    python3 scripts/device/phases.py $X/out/ft-$run.log
    cp /tmp/x/ft-run/report.json $X/out/ft-$run.json 2>/dev/null
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('secs_per_step', d['secs_per_step'], [round(s['secs']*1000,1) for s in d['steps']])" $X/out/ft-$run.json
    done
done
done
# PROFILE=1: where a step's time goes, with the plain build: the launches of 20 steps against 30
# (CubeCL's kernel log, level "minimal"), and when the machine has Nsight Systems, its CUDA API
# and kernel summaries of a 20-step run (host time in launches and copies vs the kernels' time).
if [ -n "${PROFILE:-}" ]; then
    which nsys ncu perf 2>&1 | head -3
    declare -A n=()
    # (more steps than the config's 10 of warm-up, which it requires)
    for steps in 20 30; do
        rm -rf /tmp/x/ft-run /tmp/x/ft-export; d=$(mktemp -d)
        sed "s#^steps = .*#steps = $steps#" $X/ft.toml > $d/ft.toml
        # CubeCL reads cubecl.toml from the working directory: the repository root (the config's
        # paths are relative to it).
        printf '[profiling.logger]\nlevel = "minimal"\nfile = "%s/kernels.log"\n' "$d" > cubecl.toml
        timeout 120 $X/kakeya-cuda train f-theta --config $d/ft.toml --device cuda > $d/log 2>&1; rm cubecl.toml
        cp $d/log $X/out/profile-$steps.log
        n[$steps]=$(grep -c Executing $d/kernels.log); echo "$steps steps: ${n[$steps]} launches"
        grep Executing $d/kernels.log | awk '{print $2}' | sed 's/_[0-9a-f]*$//' | sort | uniq -c > $X/out/kernels-$steps.txt
    done
    echo "launches per step: $(( (n[30] - n[20]) / 10 ))"
    # Per kernel, the launches of the ten steps between the two runs, a step's worth.
    python3 - $X/out/kernels-20.txt $X/out/kernels-30.txt <<'PY' | tee $X/out/launches-per-step.txt
import sys
a, b = ({l.split()[1]: int(l.split()[0]) for l in open(p)} for p in sys.argv[1:3])
for n, k in sorted(((b.get(k, 0) - a.get(k, 0)) / 10, k) for k in set(a) | set(b))[::-1]:
    if n: print(f"{n:7.1f} {k}")
PY
    if command -v nsys > /dev/null; then
        rm -rf /tmp/x/ft-run /tmp/x/ft-export
        sed "s#^steps = .*#steps = 30#" $X/ft.toml > /tmp/x/ft30.toml
        timeout 200 nsys profile -t cuda,osrt -o $X/out/ft --force-overwrite true \
            $X/kakeya-cuda train f-theta --config /tmp/x/ft30.toml --device cuda > $X/out/nsys.log 2>&1
        nsys stats -r cuda_api_sum,cuda_gpu_kern_sum,cuda_gpu_mem_time_sum $X/out/ft.nsys-rep > $X/out/nsys-stats.txt 2>&1
        head -60 $X/out/nsys-stats.txt; rm -f $X/out/ft.nsys-rep $X/out/ft.sqlite
    fi
fi
tar czf $OUT/ft.tgz -C $X out
