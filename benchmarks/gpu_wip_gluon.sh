#!/usr/bin/env bash
# One device call for branch wip/gluon-mla (issue 33): the never-run Gluon kernels (kernels/gluon/mla.py, the
# prefill's ping-pong, PIPE 2) checked and measured, every step under a timeout (a barrier bug hangs, it does
# not fail). Usage on the device machine, repository root: OUT=... bash benchmarks/gpu_wip_gluon.sh
#   1. tests/test_gluon.py's GPU tests (MLA vs the Triton mla_decode with NaN past each length; ping-pong parity)
#   2. parity run --suite ci --op mla.decode,attention.prefill --backend gluon -> $OUT/ci-gluon-wip.jsonl
#   3. benchmarks/gpu_gluon.py --sections mla,attn_bench,bench (with the quantizer sweep) -> $OUT/gluon-wip-bench.json
#   4. the six gl-mla-* mutants -> $OUT/mutants-gluon-mla.json
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
P="python3 -m kernel_parity.conformance.cli"
rc=0
STEPS="${STEPS:-tests ci bench mutants}"  # a device call has 600 s: e.g. STEPS="tests ci bench", then STEPS=mutants
for step in $STEPS; do
  case $step in
    tests) timeout 200 python3 -m pytest -q -x tests/test_gluon.py -k "gpu" >"$OUT/tests-gluon-wip.txt" 2>&1 || rc=1
           tail -5 "$OUT/tests-gluon-wip.txt" ;;
    ci) timeout 100 $P run --suite ci --op mla.decode,attention.prefill --backend gluon --no-progress -q --jobs 8 \
          --timeout 60 --json "$OUT/ci-gluon-wip.jsonl" 2>&1 | tail -3 || rc=1 ;;
    bench) timeout 240 python3 benchmarks/gpu_gluon.py --sections mla,attn_bench,bench --configs default \
             --out "$OUT/gluon-wip-bench.json" 2>&1 | tail -2 || rc=1 ;;
    mutants) MUT=$(grep -o 'id = "gl-mla-[a-z0-9-]*"' conformance/mutants/gluon.toml | sed 's/id = "\(.*\)"/\1/' | paste -sd,)
             timeout 400 $P mutants --mutant "$MUT" --jobs 4 --timeout 60 -q --json "$OUT/mutants-gluon-mla.json" 2>&1 \
               | tail -8 || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
