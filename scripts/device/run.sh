#!/bin/bash
# Device side of scripts/device/pack.sh: joins the parts gathered in /tmp/x, checks the hash, and
# times f_θ training steps (the 270M config on one capture shard) on CUDA and on the CPU.
# Output in $OUT: <device>.log, report-<device>.json, curves-cuda.png.
R=$(pwd); X=/tmp/x
mkdir -p $X && mv .xfer/parts/p* $X/ 2>/dev/null
cat $(ls $X/p? | sort) > $X/payload.tar
echo "$(cat .xfer/payload.sha)  $X/payload.tar" | sha256sum -c || exit 3
cd $X && tar xf payload.tar && rm -f p? payload.tar && xz -d kakeya-cuda.xz && chmod +x kakeya-cuda
cd $R && mkdir -p models/gemma-3-270m && mv $X/verifier.gguf models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf
# The toolkit's NVRTC; not its lib/stubs folder, whose libcuda.so stub hides the driver's.
export LD_LIBRARY_PATH=$(dirname "$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libnvrtc.so* | head -1)")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
for dev in cuda cpu; do
  case $dev in cuda) steps=200;; cpu) steps=30;; esac
  sed -e "s#^steps = 40#steps = $steps#" -e "s#/tmp/x/run#/tmp/x/run-$dev#" -e "s#/tmp/x/export#/tmp/x/export-$dev#" $X/cfg.toml > $X/cfg-$dev.toml
  echo "== $dev, $steps steps"
  timeout 250 $X/kakeya-cuda train f-theta --config $X/cfg-$dev.toml --device $dev > $OUT/$dev.log 2>&1; echo "rc=$?"
  tail -3 $OUT/$dev.log
  cp $X/run-$dev/report.json $OUT/report-$dev.json 2>/dev/null
done
cp $X/run-cuda/curves.png $OUT/curves-cuda.png 2>/dev/null
