#!/bin/bash
# Sourced by the device-side scripts (run.sh, run_infer.sh) in the repository root there: joins
# the parts gathered in /tmp/x (and the last, carried in .xfer/parts), checks the payload's hash,
# unpacks it into /tmp/x, decompresses kakeya (and what else came xz-compressed), puts the
# verifier GGUF where the CLI looks for it, and points LD_LIBRARY_PATH at the toolkit's NVRTC.
R=$(pwd); X=/tmp/x
mkdir -p $X && mv .xfer/parts/p* $X/ 2>/dev/null
cat $(ls $X/p? | sort) > $X/payload.tar
echo "$(cat .xfer/payload.sha)  $X/payload.tar" | sha256sum -c || exit 3
(cd $X && tar xf payload.tar && rm -f p? payload.tar && xz -d ./*.xz && chmod +x kakeya-* golden-* test-* 2>/dev/null; [ -x kakeya-cuda ]) || exit 4
mkdir -p models/gemma-3-270m
[ -f $X/verifier.gguf ] && mv $X/verifier.gguf models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf
[ -f $X/tokenizer.json ] && mv $X/tokenizer.json models/gemma-3-270m/
# The toolkit's NVRTC; not its lib/stubs folder, whose libcuda.so stub hides the driver's.
export LD_LIBRARY_PATH=$(dirname "$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libnvrtc.so* | head -1)")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
