#!/bin/bash
# Device side of `scripts/device/pack.sh f-theta`: joins the parts gathered in /tmp/x, checks the
# hash, and times f_θ training steps (the 270M config on the small capture) on CUDA with the
# plain build and, when it came along, the fused one. Output in $OUT: ft.tgz (each build's
# report.json and log).
source .xfer/unpack.sh
mkdir -p checkpoints && rm -rf checkpoints/drafter-gemma3-270m-v2 && mv $X/drafter checkpoints/drafter-gemma3-270m-v2
mkdir -p $X/out
for b in cuda alt; do
    [ -x $X/kakeya-$b ] || continue
    rm -rf /tmp/x/ft-run /tmp/x/ft-export
    echo "== kakeya-$b"
    timeout 200 $X/kakeya-$b train f-theta --config $X/ft.toml --device ${KAKEYA_DEVICE:-cuda} > $X/out/ft-$b.log 2>&1; echo "rc=$?"
    tail -1 $X/out/ft-$b.log
    cp /tmp/x/ft-run/report.json $X/out/ft-$b.json 2>/dev/null
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('secs_per_step', d['secs_per_step'], [round(s['secs']*1000,1) for s in d['steps']])" $X/out/ft-$b.json
done
tar czf $OUT/ft.tgz -C $X out
