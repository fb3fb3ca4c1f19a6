#!/bin/bash
# Device side of scripts/device/pack.sh: joins the parts gathered in /tmp/x, checks the hash, and
# times f_θ training steps (the 270M config on one capture shard) on CUDA and on the CPU.
# Output in $OUT: <device>.log, report-<device>.json, curves-cuda.png.
source .xfer/unpack.sh
for dev in cuda cpu; do
  case $dev in cuda) steps=200;; cpu) steps=30;; esac
  sed -e "s#^steps = 40#steps = $steps#" -e "s#/tmp/x/run#/tmp/x/run-$dev#" -e "s#/tmp/x/export#/tmp/x/export-$dev#" $X/cfg.toml > $X/cfg-$dev.toml
  echo "== $dev, $steps steps"
  timeout 250 $X/kakeya-cuda train f-theta --config $X/cfg-$dev.toml --device $dev > $OUT/$dev.log 2>&1; echo "rc=$?"
  tail -3 $OUT/$dev.log
  cp $X/run-$dev/report.json $OUT/report-$dev.json 2>/dev/null
done
cp $X/run-cuda/curves.png $OUT/curves-cuda.png 2>/dev/null
