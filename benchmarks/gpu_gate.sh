#!/usr/bin/env bash
# One device-machine call: install the project, then (each step optional, by name in $STEPS)
#   ci      parity gate --suite ci            -> $OUT/ci-<device>.jsonl
#   models  parity run --suite models         -> $OUT/models-<device>.jsonl ($MODELS_FLAGS added: e.g.
#           "--devices 0 --jobs 16 --schedule reports/baselines/<an earlier models run>")
#   full    the models suite's row-independent ops (every spec with `rows`) judged whole (--sample off), for the
#           verdict comparison with the sampled run -> $OUT/models-full-<device>.jsonl
#   tf32    parity mutants of the gpu-only (tf32) mutants -> $OUT/mutants-gpu-<device>.json
#   fresh   parity sweep --suite ci $OPS --per-op $PER_OP (--start $START): fresh seeds on every backend of the
#           ci cases, the GPU ones natively -> $OUT/sweep-ci<tag>-<device>.jsonl
#   thorough parity gate --suite ci --changed-since $REF --thorough-seeds $THOROUGH (default HEAD, 2): the seeds
#           a change's gate draws -> $OUT/thorough<tag>-<device>.jsonl
#   sweep   parity sweep --suite models --backend triton (+ torch) -> $OUT/sweep-models-<device>.jsonl
#   gemm    benchmarks/gpu_gemm.py (quantized GEMMs vs torch / _scaled_mm and the limits) -> $OUT/gemm-bench-<device>.json
#   q8      triton-q8 (Q4_K x Q8_K, Q8_0 x Q8_0; kernels/triton/gemm_q8.py): its ci cases on the GPU, then the q8 section
#           of benchmarks/gpu_gemm.py with its sweep -> $OUT/ci-q8-<device>.jsonl, $OUT/q8-bench-<device>.json
#   gluon-mla  the gluon step's MLA decode part under timeouts (fits one 600 s call): the gl-mla-* mutants, ci, fresh
#           seeds, the models suite -> $OUT/{mutants,ci,sweep,models}-gluon-mla-<device>.json[l]
#   gluon-gemv the same for the GEMVs, Q4_K and Q8_0 (the 18 gl-gemv-* mutants; gemm.gemm_nt on gluon; fresh seeds:
#           two for every ci combination, as a per-op draw seldom lands on its few M = 1 entries) -> $OUT/{mutants,ci,
#           sweep,models}-gluon-gemv-<device>.json[l]; at most 510 s (280 s measured)
#   gluon-mlaf the same for the fused FP8 MLA branch (the ten gl-mlaf-* mutants; mla.decode_fused_fp8 on gluon; fresh
#           seeds --seeds 3) -> $OUT/{mutants,ci,sweep,models}-gluon-mlaf-<device>.json[l]; ~300 s measured by hand
#   gluon-gemv-bench `gpu_gluon.py --sections gemv` (both GEMVs at their configs against triton-q8 and a pure read)
#           -> $OUT/gemv-bench-<device>.json; 125 s measured, so both gemv steps fit one 600 s call
#   mla     benchmarks/gpu_mla.py (MLA decode vs the copy / matmul limits and FlashMLA's figures) -> $OUT/mla-bench-<device>.json
#   layers  benchmarks/gpu_{norm,rope,mlp}.py (RMSNorm, LayerNorm, RoPE, SwiGLU / GeGLU vs the copy rate, torch and
#           the peers that import) -> $OUT/{norm,rope,mlp}-bench-<device>.json
#   peers   the `peers` suite (liger, quack on norm / rope / mlp cases) -> $OUT/peers-<device>.jsonl
#   kvquant benchmarks/gpu_kvquant.py (the quantized-cache decode vs the bf16-cache decode and the read ceiling, parity
#           bench), then its --tune sweep (fast_cvt x configs x splits, CUDA-graph timing of the best) ->
#           $OUT/kvquant-bench-<device>.json, $OUT/kvquant-tune-<device>.json
#   moe     benchmarks/gpu_moe.py --models $MOE_MODELS (default mixtral,qwen3; deepseek's 22.5 GB layer wants a call
#           of its own) -> $OUT/moe-bench<tag>-<device>.json
#   profile benchmarks/gpu_profile.py (ncu: every issue-19 target, ours and the peers) -> $OUT/profile-<device>.json
#   prefill benchmarks/gpu_prefill.py (causal prefill: ours, fa4, cuDNN, SDPA flash; parity bench), then the
#           fa4 plugin's ci cases -> $OUT/prefill-bench-<device>.json, $OUT/ci-fa4-<device>.jsonl
#   gluon   the gluon backend (kernels/gluon, Hopper): its ci cases, fresh seeds (--per-op $PER_OP), the models
#           suite's FP8 GEMM, prefill, MLA decode and fused FP8 MLA cases, every gluon mutant, the property tests of attention and gemm on it,
#           then benchmarks/gpu_gluon.py (parity + bench of both kernels) -> $OUT/{ci,sweep,models}-gluon-<device>.jsonl,
#           $OUT/mutants-gluon-<device>.json, $OUT/props-gluon-<device>.txt, $OUT/gluon-bench-<device>.json
# Peers: wheels carried in .whl/ (liger-kernel, quack-kernels, flash-attn-4, nvidia-cutlass-dsl and its libs,
# apache-tvm-ffi, torch-c-dlpack-ext, einops; research/peers-measured.md; flash-attn-4 4.0.0b36 imports
# quack) are installed into /tmp/peers first when present; a wheel over one call's 64 MiB travels in parts
# (.whl/*.part*, joined in name order) over calls on a warm machine.
# $OPS narrows ci / models / sweep to some op families (e.g. OPS="--op quant --op gemm"); $TAG is
# added to the file names.
# Usage (on the device machine, repository root): STEPS="ci models" bash benchmarks/gpu_gate.sh
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
STEPS="${STEPS:-ci models tf32 sweep}"
JOBS="${JOBS:-8}"
PER_OP="${PER_OP:-40}"
OPS="${OPS:-}"
TAG="${TAG:-}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
PARITY="python3 -m kernel_parity.conformance.cli"
DEV=$(python3 -c "import torch; n = torch.cuda.get_device_name(0).lower(); print('h200' if 'h200' in n else 'h100' if 'h100' in n else n.replace(' ', '-'))")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ls .whl/*.whl >/dev/null 2>&1; then
  for base in $(ls .whl/*.part* 2>/dev/null | sed 's/\.part[0-9]*$//' | sort -u); do cat "$base".part* > "$base"; done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .whl/*.whl >>"$OUT/pip.log" 2>&1 \
    || { tail -5 "$OUT/pip.log"; exit 1; }
  SP=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('/tmp/peers')" > "$SP/zz_kernel_parity_peers.pth"  # cutlass-dsl is a .pth
fi
gluon_part() {  # NAME OP MODELS_TIMEOUT SWEEP MUTANTS_TIMEOUT: the gl-NAME-* mutants, ci, fresh seeds (SWEEP: sweep's
                #  seed flags) and the models suite of OP on gluon
  local r=0 mop="--op $2 --backend gluon --no-progress -q"
  local mut
  mut=$(grep -o "id = \"gl-$1-[a-z0-9-]*\"" conformance/mutants/gluon.toml | sed 's/id = "\(.*\)"/\1/' | paste -sd,)
  timeout "$5" $PARITY mutants --mutant "$mut" --jobs 4 --timeout 60 -q --json "$OUT/mutants-gluon-$1-$DEV.json" || r=1
  timeout 60 $PARITY run --suite ci $mop --jobs "$JOBS" --json "$OUT/ci-gluon-$1-$DEV.jsonl" || r=1
  timeout 60 $PARITY sweep --suite ci $mop --dtype bf16,fp16 $4 ${START:+--start "$START"} \
    --jobs "$JOBS" --json "$OUT/sweep-gluon-$1-$DEV.jsonl" || r=1
  timeout "$3" $PARITY run --suite models $mop --jobs 12 --json "$OUT/models-gluon-$1-$DEV.jsonl" || r=1
  return $r
}
rc=0
for step in $STEPS; do
  t0=$(date +%s)
  case $step in
    ci) $PARITY gate --suite ci $OPS --no-progress -q --jobs "$JOBS" --json "$OUT/ci$TAG-$DEV.jsonl" || rc=1 ;;
    models) $PARITY run --suite models $OPS ${MODELS_FLAGS:-} --no-progress -q --jobs "$JOBS" \
              --json "$OUT/models$TAG-$DEV.jsonl" || rc=1 ;;
    full) SAMPLED=$(python3 -c "from kernel_parity.conformance import ops
print(','.join(sorted(n for n, s in ops.all_specs().items() if s.rows is not None)))")
          $PARITY run --suite models --op "$SAMPLED" ${MODELS_FLAGS:-} --sample off --no-progress -q --jobs "$JOBS" \
            --json "$OUT/models-full$TAG-$DEV.jsonl" || rc=1 ;;
    tf32) $PARITY mutants --bug tf32 --json "$OUT/mutants-gpu-$DEV.json" || rc=1 ;;
    fresh) $PARITY sweep --suite ci $OPS --per-op "$PER_OP" ${START:+--start "$START"} --no-progress -q --jobs "$JOBS" \
             --json "$OUT/sweep-ci$TAG-$DEV.jsonl" || rc=1 ;;
    thorough) $PARITY gate --suite ci $OPS --changed-since "${REF:-HEAD}" --thorough-seeds "${THOROUGH:-2}" --no-progress \
                -q --jobs "$JOBS" --json "$OUT/thorough$TAG-$DEV.jsonl" || rc=1 ;;
    sweep) $PARITY sweep --suite models $OPS --backend triton --per-op "$PER_OP" --no-progress -q --jobs "$JOBS" \
             --json "$OUT/sweep-models$TAG-$DEV.jsonl" || rc=1 ;;
    gemm) python3 benchmarks/gpu_gemm.py --quick --out "$OUT/gemm-bench-$DEV.json" --budget-s "${BUDGET_S:-60}" || rc=1 ;;
    q8) $PARITY run --suite ci --backend triton-q8 --op gemm.gemm_nt --no-progress -q --jobs "$JOBS" \
          --json "$OUT/ci-q8-$DEV.jsonl" || rc=1
        python3 benchmarks/gpu_gemm.py --sections q8 --out "$OUT/q8-bench-$DEV.json" --budget-s "${BUDGET_S:-120}" || rc=1 ;;
    gluon) GOPS="--op attention.prefill,gemm.gemm_nt,mla.decode,mla.decode_fused_fp8"
           $PARITY run --suite ci $GOPS --backend gluon --no-progress -q --jobs "$JOBS" --json "$OUT/ci-gluon-$DEV.jsonl" || rc=1
           $PARITY sweep --suite ci $GOPS --backend gluon --dtype bf16,fp16 --per-op "$PER_OP" ${START:+--start "$START"} \
             --no-progress -q --jobs "$JOBS" --json "$OUT/sweep-gluon-$DEV.jsonl" || rc=1
           $PARITY run --suite models $GOPS --backend gluon --no-progress -q --jobs "$JOBS" --json "$OUT/models-gluon-$DEV.jsonl" || rc=1
           $PARITY mutants --backend gluon --jobs 4 --json "$OUT/mutants-gluon-$DEV.json" || rc=1
           python3 -m pytest -q property_tests/test_attention.py property_tests/test_gemm.py \
             --parity-backend kernel_parity.conformance.backends.gluon_backend:BACKEND >"$OUT/props-gluon-$DEV.txt" 2>&1 || rc=1
           tail -3 "$OUT/props-gluon-$DEV.txt"
           timeout 600 python3 -m pytest -q tests/test_gluon.py >"$OUT/tests-gluon-$DEV.txt" 2>&1 || rc=1
           tail -3 "$OUT/tests-gluon-$DEV.txt"
           timeout 900 python3 benchmarks/gpu_gluon.py --out "$OUT/gluon-bench-$DEV.json" \
             --sections api,parity,bench,attn_parity,attn_bench,mla,gemv --configs default || rc=1 ;;
    gluon-mla) gluon_part mla mla.decode 250 "--per-op $PER_OP" 170 || rc=1 ;;  # the gluon step's MLA decode part, in one call
    gluon-mlaf) gluon_part mlaf mla.decode_fused_fp8 170 "--seeds 3" 240 || rc=1 ;;  # the fused FP8 MLA branch's part
    gluon-gemv) gluon_part gemv gemm.gemm_nt 150 "--seeds 2" 240 || rc=1 ;;  # its GEMV part (FP8 GEMM cases ride along)
    gluon-gemv-bench) timeout 220 python3 benchmarks/gpu_gluon.py --sections gemv --out "$OUT/gemv-bench-$DEV.json" || rc=1 ;;
    mla) python3 benchmarks/gpu_mla.py --out "$OUT/mla-bench-$DEV.json" --tune-budget "${BUDGET_S:-60}" || rc=1 ;;
    layers) for f in norm rope mlp; do python3 benchmarks/gpu_$f.py --out "$OUT/$f-bench-$DEV.json" || rc=1; done ;;
    peers) $PARITY run --suite peers --no-progress -q --jobs "$JOBS" --json "$OUT/peers-$DEV.jsonl" || rc=1 ;;
    prefill) python3 benchmarks/gpu_prefill.py --out "$OUT/prefill-bench-$DEV.json" || rc=1
             $PARITY run --suite ci --backend fa4 --no-progress -q --jobs "$JOBS" --json "$OUT/ci-fa4-$DEV.jsonl" \
               || rc=1 ;;
    kvquant) python3 benchmarks/gpu_kvquant.py --out "$OUT/kvquant-bench-$DEV.json" || rc=1
             python3 benchmarks/gpu_kvquant.py --tune --out "$OUT/kvquant-tune-$DEV.json" || rc=1 ;;
    moe) python3 benchmarks/gpu_moe.py --models "${MOE_MODELS:-mixtral,qwen3}" --out "$OUT/moe-bench$TAG-$DEV.json" || rc=1 ;;
    profile) python3 benchmarks/gpu_profile.py --out "$OUT/profile-$DEV.json" || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "step $step: $(( $(date +%s) - t0 )) s"
done
exit $rc
