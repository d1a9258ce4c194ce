#!/usr/bin/env bash
# GPU checks and timings for a session, in steps (see benchmarks/NOTES.md).
#   device run: bash scripts/gpu_session.sh [steps...]   with carry [".whl"] (../shared/gpu/wheels.sh fetches it)
# Steps (default: all, in this order): correctness compiler throughput latency peers; also: warmstart startup
# first_wave (FIRST_WAVE_VARIANTS) first_wave_server (carry [".whl"]) rebuild (two 26B-A4B engines in one process)
# scoring (a 4K-token echo+logprobs request against a plain prefill: time and peak memory)
# structured (compiled, --jit-monitor error; carry [".whl"] with xgrammar's wheels in .whl/structured/)
# kernels (check_kernels_gpu.py, KERNELS_ARGS) gluon_moe (GLUON_MOE_TOKENS, GLUON_UP_VARIANTS) gluon_moe_engine gluon_moe_down_engine decode_qk decode_qk_ab (QK_AB, QK_AB_SHAPES) kernel_check (KCHECK_CONFIG) moe_unsorted moe_align router prefill_kernels ffn_overlap sparse sparse_host sparse_check sparse_kv decode_attn norm_chain pdl_chain qwen_tiny qwen_tiny32 qwen_bisect state_kernels qwen_smoke qwen_big big26 big26_none skinny moe_stream moe_routing serving offline32 aot_tput startup_json env; env_ab (AB_ENV, AB_VALUES, AB_SHAPES);
# throughput_quick (the three shapes, async, one warm-up and two runs each);
# two GPUs: par_modes par_compiled par_bf16 (PAR_MODES) par_kill arnorm arnorm_e2e tp2_big tp2_tput (TP_ALLREDUCE, TP_ARGS) one_tput
# Every step has its own time limit and writes its log under $OUT, so one failure costs only that step.
# A device call runs at most 10 minutes: give two or three steps per call (e.g. "correctness compiler").
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16
# the GPU image's site-packages has no bytecode caches: every fresh process compiled ~2,400 modules (torch,
# sympy, ...) from source, ~5-7 s of each start-up (session 9's warm-start profile); a pip-installed
# deployment has them, so keep them here too, in a writable folder the first process fills
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE  # (session 10: the caches were not written; this variable is the usual cause)
# carried wheels (`bash ../shared/gpu/wheels.sh fastapi uvicorn openai ...`): the server's packages always,
# FlashInfer only with WITH_FLASHINFER=1 (installed, it becomes a provider candidate and JIT-builds on first use)
wheels=$(ls .whl/*.whl 2>/dev/null | grep -v -E "$([ "${WITH_FLASHINFER:-0}" = 1 ] && echo '^$' || echo 'flashinfer|tvm_ffi')")
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
steps=${*:-correctness compiler throughput latency peers}

run() {  # name, seconds, command... (STEP_LIMIT, when set, caps the step's seconds: the caller's time left)
  local name=$1 limit=$2; shift 2
  [ -n "${STEP_LIMIT:-}" ] && [ "$STEP_LIMIT" -lt "$limit" ] && limit=$STEP_LIMIT
  echo "=== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -i warning "$OUT/$name.log" | tail -15
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 ))s"
}

tiny_all() {  # the tiny float32 Gemma 4 with every feature, for the parallel checks
  [ -d /tmp/ckpt_all ] || python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \
from tiny_models import make_checkpoint; make_checkpoint(Path('/tmp/ckpt_all'), 'all')"
}

serve_model() {  # a dummy-weight checkpoint of preset $1 with a one-word-per-id tokenizer, in /tmp/serve_model
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from configs import config_dict, write_checkpoint_folder, write_word_tokenizer; \
write_word_tokenizer(write_checkpoint_folder('$1', Path('/tmp/serve_model')), config_dict('$1')['vocab_size'])"
}

wait_healthy() {  # until the server on port 8011 answers /health (at most ~400 s)
  python3 -c "import time, urllib.request as u
for _ in range(400):
    try: u.urlopen('http://127.0.0.1:8011/health', timeout=2); print('server up'); break
    except Exception: time.sleep(1)"
}

ab_rounds() {  # name, variable, values, shapes: AB_CONFIG's (default Gemma 4) throughput at each value, two rounds
  local name=$1 var=$2 round v
  for round in 1 2; do
    for v in $3; do
      # a subshell, so the caller keeps its own value of the variable
      (export "$var=$v"; run ${name}_${v}_$round 200 python3 benchmarks/throughput.py \
        --config ${AB_CONFIG:-gemma-4-26b-a4b} --shapes $4 --async-scheduling --warmup 1 --runs 2 \
        --out "$OUT/${name}_${v}_$round")
    done
  done
}

for step in $steps; do
  case $step in
    kernel_check) run kernel_check 200 python3 scripts/kernel_check_gpu.py --config ${KCHECK_CONFIG:-gemma-4-26b-a4b} \
                    --out "$OUT/kernel_check_${KCHECK_CONFIG:-gemma-4-26b-a4b}.json" ;;  # CPU-recorded builds = the GPU's?
    kernels) run kernels 180 python3 scripts/check_kernels_gpu.py ${KERNELS_ARGS:---only decode,logits --no-time} ;;
    decode_qk) run decode_qk 90 python3 scripts/check_decode_qk_gpu.py ;;  # the decode kernel's QK form vs the op's launch
    decode_qk_ab)  # issue 14: the decode's QK forms alternating, two rounds (COMPILED_LLM_DECODE_QK values: QK_AB)
      ab_rounds decode_qk_ab COMPILED_LLM_DECODE_QK "${QK_AB:-1 2}" \
        "${QK_AB_SHAPES:-1024x1x128,1024x8x256,8192x4x512}" ;;
    env_ab)  # A/B: AB_ENV set to each of AB_VALUES alternating, two rounds, AB_CONFIG's throughput at AB_SHAPES
      ab_rounds env_ab "${AB_ENV:?AB_ENV names the variable}" "${AB_VALUES:-0 1}" \
        "${AB_SHAPES:-1024x1x128,1024x8x256,8192x4x512}" ;;
    correctness) run correctness 240 python3 scripts/gpu_check.py --compiled --names ${CHECK_NAMES:-all,moe,k_eq_v} ;;
    structured)  # xgrammar and its tvm_ffi from .whl/structured/, for this step only (other steps' start-ups unchanged)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_x \
        .whl/structured/*.whl
      PYTHONPATH=/tmp/site_x:$PYTHONPATH run structured 240 python3 scripts/compiler_gpu_check.py --sections structured \
        --out "$OUT" ;;
    compiler) run compiler 240 python3 scripts/compiler_gpu_check.py --sections kernels,models --names dense32,moe32,all32 --out "$OUT" ;;
    throughput) run throughput 420 python3 benchmarks/throughput.py --config gemma-4-26b-a4b \
                  --shapes 1024x8x256,4096x8x512,8192x4x512 --out "$OUT" ;;
    throughput_quick) run throughput_quick 300 python3 benchmarks/throughput.py --config gemma-4-26b-a4b \
                        --shapes 1024x8x256,4096x8x512,8192x4x512 --async-scheduling --warmup 1 --runs 2 ${TPUT_ARGS:-} \
                        --out "$OUT" ;;  # e.g. TPUT_ARGS="--cudagraph-batch-sizes 1,2,4,8" (no prompt graphs)
    latency) run latency 240 python3 benchmarks/latency.py --config gemma-4-26b-a4b --ttft-lengths 1024,8192 \
               --out "$OUT/latency.json" --profile-dir "$OUT/latency_profile" ${LATENCY_ARGS:-} ;;
    peers) run peers 540 python3 benchmarks/throughput.py --config gemma-4-26b-a4b --shapes 1024x8x256 \
             --async-scheduling --warmup 1 --runs 3 --peer transformers --peer transformers-static \
             --peer-warmup 1 --peer-runs 2 --out "$OUT" ;;
    moe_unsorted) run moe_unsorted 150 python3 benchmarks/moe_kernels.py --tokens 1,2,8 --unsorted \
                    --out "$OUT/moe_unsorted.json" ;;  # one token's pairs unsorted (no alignment launch) vs aligned
    moe_align) run moe_align${MOE_ALIGN_TAG:-} 100 python3 benchmarks/moe_kernels.py --tokens ${MOE_ALIGN_TOKENS:-128,512,1024,2048,8192} \
                 ${MOE_ALIGN_ARGS:-} --out "$OUT/moe_align${MOE_ALIGN_TAG:-}.json" ;;  # the one-program, sort-based and parallel alignments (prefill sizes); Qwen3.5: MOE_ALIGN_ARGS="--experts 256 --hidden 2048 --inter 512"
    gluon_moe)  # issue 14: the Gluon MoE prototypes (down, then gate/up) checked against the engine's kernels, timed
      run gluon_moe_down 150 python3 benchmarks/gluon_moe_down.py --tokens ${GLUON_MOE_TOKENS:-2048,4096,8192}
      run gluon_moe_gate_up 150 python3 benchmarks/gluon_moe_gate_up.py --tokens ${GLUON_MOE_TOKENS:-2048,4096,8192} \
        --variants ${GLUON_UP_VARIANTS:-f128x4,w128x4,w64x6} ;;
    gluon_moe_engine)  # issue 14 (session 66): the engine's Gluon gate/up (MoELaunch.gluon) checked against fp32, its
      # SwiGLU form (Qwen3.5's shapes) checked and timed against the Triton kernel, then TTFT with it on and off
      run kernels_moe 120 python3 scripts/check_kernels_gpu.py --only moe --no-time
      run gluon_up_qwen 90 python3 benchmarks/gluon_moe_gate_up.py --qwen --tokens 4096,8192 --variants f128x4
      run latency_moe_gluon 300 python3 benchmarks/latency.py --config gemma-4-26b-a4b --ttft-lengths 4096,8192 \
        --alternate-env COMPILED_LLM_MOE_GLUON=1,0 --warmup 1 --runs 7 --decode-tokens 16 \
        --out "$OUT/latency_moe_gluon.json" ;;
    gluon_moe_down_engine)  # issue 14 (session 67): the engine's Gluon down GEMM (COMPILED_LLM_MOE_GLUON_DOWN=1, off by
      # default) checked against fp32 in the whole MoE, the prototype's tiles timed beside the Triton kernel, then
      # TTFT alternating the switch
      COMPILED_LLM_MOE_GLUON_DOWN=1 run kernels_moe_down 120 python3 scripts/check_kernels_gpu.py --only moe --no-time
      run gluon_moe_down 120 python3 benchmarks/gluon_moe_down.py --tokens 2048,8192 --variants p128x4,p256x3,w256x3
      run latency_moe_gluon_down 300 python3 benchmarks/latency.py --config gemma-4-26b-a4b --ttft-lengths 4096,8192 \
        --alternate-env COMPILED_LLM_MOE_GLUON_DOWN=0,1 --warmup 1 --runs 7 --decode-tokens 16 \
        --out "$OUT/latency_moe_gluon_down.json" ;;
    prefill_kernels)  # issue 14: router / MoE / attention tiles at prefill sizes (and decode's MoE), PREFILL_ARGS
      # e.g. "--qwen --groups router,moe"; the candidates' kernels are built by 12 processes first (Triton's cache)
      tag=${PREFILL_TAG:-gemma}; b0=$(date +%s)
      for i in $(seq 0 11); do timeout 240 python3 benchmarks/prefill_kernels.py ${PREFILL_ARGS:-} --compile-shard $i/12 \
        > "$OUT/prefill_build_${tag}_$i.log" 2>&1 & done; wait
      echo "prefill_kernels $tag: candidates built in $(( $(date +%s) - b0 ))s"
      run prefill_kernels_$tag 300 python3 benchmarks/prefill_kernels.py ${PREFILL_ARGS:-} \
        --out "$OUT/prefill_kernels_$tag.json" ;;
    grouped_mm)  # issue 14: the routed experts at prefill sizes, our Triton kernels vs torch._grouped_mm (CUTLASS)
      run grouped_mm_gemma 150 python3 benchmarks/grouped_mm_moe.py --config gemma --out "$OUT/grouped_mm_gemma.json"
      run grouped_mm_qwen 120 python3 benchmarks/grouped_mm_moe.py --config qwen --tokens 1024,8192 \
        --out "$OUT/grouped_mm_qwen.json" ;;
    ffn_overlap)  # issue 14/18: the MoE branch on a side stream beside the dense MLP (shared expert), per layer
      run ffn_overlap 150 python3 benchmarks/ffn_overlap.py --out "$OUT/ffn_overlap.json"
      run ffn_overlap_qwen 150 python3 benchmarks/ffn_overlap.py --qwen --out "$OUT/ffn_overlap_qwen.json" ;;
    router) run router 120 python3 benchmarks/router_kernel.py --tokens 1,8,32,64 ${ROUTER_ARGS:-} \
              --out "$OUT/router_kernel.json" ;;  # Qwen3.5's shape: ROUTER_ARGS="--experts 256 --hidden 2048 --sweep"
    sparse) run sparse 150 python3 benchmarks/sparse_attention_kernel.py ${SPARSE_KERNEL_ARGS:-} ;;  # e.g. "--rows 16 --lengths 65536 --sweep"
    sparse_host) run sparse_host 120 python3 benchmarks/sparse_attention_kernel.py --lengths 65536 --host-cache ;;  # issue 19 item 2
    sparse_check) run sparse_check 200 python3 scripts/check_sparse_gpu.py --out "$OUT/sparse_check.json" ;;  # tokens, whole graph
    sparse_kv)  # issue 19: 26B-A4B end to end at long prompts (SPARSE_METHODS, _LENGTHS, _BATCH), each method in a
      # process of its own: a second engine in one process got a third of the first's KV blocks (session 16)
      ms=${SPARSE_METHODS:-dense}; for m in ${ms//,/ }; do
      run sparse_kv_${m}_b${SPARSE_BATCH:-16} 300 python3 benchmarks/sparse_kv.py --config gemma-4-26b-a4b \
        --methods $m --lengths ${SPARSE_LENGTHS:-64k} --batch ${SPARSE_BATCH:-16} \
        --output ${SPARSE_OUTPUT:-256} --max-num-batched-tokens 8192 --profile-steps ${SPARSE_PROFILE:-0} \
        ${SPARSE_SYNTH:+--synthetic-prefill} --out "$OUT"  # SPARSE_SYNTH=1: decode-only (no prefill compute)
      done ;;
    l2_prefetch) run l2_prefetch 200 python3 benchmarks/l2_prefetch.py ${L2_ARGS:-} \
                   --out "$OUT/l2_prefetch${L2_TAG:-}.json" ;;  # issue 14: the o weight asked of L2 during attention
    pdl_chain) run pdl_chain 200 python3 benchmarks/pdl_chain.py --out "$OUT/pdl_chain.json" ;;  # PDL + L2 prefetch A/B
    norm_chain) run norm_chain 200 python3 benchmarks/norm_chain.py --out "$OUT/norm_chain.json" ;;  # norms by size
    decode_attn) run decode_attn 240 python3 benchmarks/decode_attention.py ${DECODE_ATTN_ARGS:-} \
                   --out "$OUT/decode_attention.json" ;;  # decode attention policies, KV read from HBM (issue 14)
    qwen_tiny) run qwen_tiny 200 python3 scripts/gpu_smoke.py --sections tiny --names qwen_dense,qwen_moe --budget 180 \
                 --out "$OUT/qwen_tiny" ;;
    qwen_big) run qwen_big 330 python3 benchmarks/throughput.py --config qwen3.5-35b-a3b --shapes 1024x8x256 \
                --async-scheduling --warmup 1 --runs 3 ${QWEN_PEERS:---peer transformers} --peer-warmup ${QWEN_PEER_WARMUP:-1} \
                --peer-runs 1 --out "$OUT" ;;  # QWEN_PEERS="--peer transformers --peer transformers-static"
    state_kernels) run state_kernels 150 python3 benchmarks/state_kernels.py --batches ${STATE_BATCHES:-1,8,32} ${STATE_ARGS:-} \
                     --out "$OUT/state_kernels.json" ;;  # issue 18: Qwen3.5's conv and delta-rule decode tiles
    qwen_bisect) run qwen_bisect 300 python3 scripts/qwen_bf16_bisect.py --names ${BISECT_NAMES:-qwen_dense} \
                   --variants ${BISECT_VARIANTS:-compiled,passes_none,norm_triton,qk_ref,gdr_ref,conv_ref,no_graphs} \
                   --out "$OUT/qwen_bisect.json" ;;  # issue 18: which part moves compiled bf16 logprobs
    qwen_tiny32) run qwen_tiny32 200 python3 scripts/gpu_smoke.py --sections tiny --names qwen_dense32,qwen_moe32 \
                   --budget 170 --out "$OUT/qwen_tiny32" ;;  # whole-graph decode for stateful models (head_dim 32)
    qwen_smoke) run qwen_smoke 260 python3 scripts/gpu_smoke.py --sections big --big qwen3.5-35b-a3b --shape 1024x8x256 \
                  ${QWEN_SMOKE_ARGS:-} --out "$OUT/qwen_smoke${QWEN_TAG:-}" ;;  # e.g. QWEN_SMOKE_ARGS="--max-autotune static"
    big26_none) run big26_none 240 python3 scripts/gpu_smoke.py --sections big --shape 1024x8x256 --compile-sizes none \
                  --out "$OUT/big26_none" ;;  # issue 15: the buckets replay the dynamic compile (fewer compiles)
    moe_routing) run moe_routing 240 python3 benchmarks/moe_routing.py ${MOE_ROUTING_ARGS:-} \
                   --out "$OUT/moe_routing${MOE_ROUTING_TAG:-}.json" ;;  # distinct experts a decode step a layer (eager), vs the floor's count; e.g. MOE_ROUTING_ARGS="--config gemma-4-26b-a4b --shape 1024x8x16"
    moe_stream) run moe_stream 120 python3 benchmarks/moe_stream.py ${MOE_STREAM_ARGS:-} \
                  --out "$OUT/moe_stream${MOE_STREAM_TAG:-}.json" ;;  # e.g. MOE_STREAM_ARGS="--qwen --parts --distinct 56 --launch b_block_k=512" MOE_STREAM_TAG=_qwen
    skinny) run skinny 300 python3 benchmarks/skinny_gemm.py ${SKINNY_ARGS:-} --out "$OUT/skinny_gemm.json" ;;  # e.g. "--models qwen --tokens 1,8 --sweep"
    big26) run big26 260 python3 scripts/gpu_smoke.py --sections big --shape ${BIG26_SHAPE:-1024x8x256} \
             ${BIG26_PASSES:+--compile-passes $BIG26_PASSES} ${BIG26_ARGS:-} --out "$OUT/big26_${BIG26_SHAPE:-1024x8x256}${BIG26_PASSES:+_passes}${BIG26_TAG:-}" ;;
    big26_serial)  # big26 with the JIT kernels built one by one at first launch (A/B of the parallel build)
      COMPILED_LLM_KERNEL_BUILD_WORKERS=0 run big26_serial 260 python3 scripts/gpu_smoke.py --sections big \
        --shape 1024x8x256 --out "$OUT/big26_serial" ;;
    serving)  # issue 14: the OpenAI server under load (1K in / 256 out, 64 requests at concurrency 8 and 32)
              # against the offline engine at the same batch; needs the server's wheels in .whl (carry [".whl"])
      # SERVE_SWITCH_MS: Python's GIL switch interval in the server (default 5 ms), through a sitecustomize: the
      # engine thread waits up to that long for the GIL after each op whenever the event loop holds it
      model=${SERVE_MODEL:-gemma-4-26b-a4b}
      serve_model $model
      site=""
      if [ -n "${SERVE_SWITCH_MS:-}" ]; then
        mkdir -p /tmp/switch && echo "import sys; sys.setswitchinterval(${SERVE_SWITCH_MS} / 1000)" > /tmp/switch/sitecustomize.py
        site=/tmp/switch:
      fi
      PYTHONPATH=$site$PYTHONPATH python3 -m compiled_llm serve --model /tmp/serve_model --load-format dummy --max-num-seqs 32 \
        --max-model-len 2048 --port 8011 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
      spid=$!
      wait_healthy
      for c in 8 32; do
        run serving_c$c 240 python3 benchmarks/serving.py --base-url http://127.0.0.1:8011/v1 --concurrency $c \
          --requests ${SERVE_REQUESTS:-64} --input-len ${SERVE_IN:-1024} --output-len ${SERVE_OUTPUT:-256} \
          --vocab ${SERVE_VOCAB:-200000} --out "$OUT/serving_c$c.json"
      done
      kill $spid; wait $spid 2>/dev/null
      tail -5 "$OUT/server.log" ;;
    first_wave)  # a fresh engine's first waves against later ones (benchmarks/first_wave.py), the server's config
      serve_model gemma-4-26b-a4b
      for v in ${FIRST_WAVE_VARIANTS:-tok_prefix tok plain}; do  # tok: --with-tokenizer, prefix: --enable-prefix-caching
        run first_wave_$v 150 python3 benchmarks/first_wave.py --model /tmp/serve_model --max-model-len 2048 \
          --max-num-seqs 32 --batch ${FIRST_WAVE_BATCH:-1} $([[ $v == *tok* ]] && echo --with-tokenizer) \
          $([[ $v == *prefix* ]] && echo --enable-prefix-caching) --out "$OUT/first_wave_$v.json"
      done ;;
    first_wave_server)  # the server's engine-thread timeline (benchmarks/server_steps.py) over three waves of 8 x 1K
      serve_model gemma-4-26b-a4b
      STEP_LOG="$OUT/server_steps.jsonl" STEP_PROFILE=2 python3 benchmarks/server_steps.py --model /tmp/serve_model --load-format dummy \
        --max-num-seqs 32 --max-model-len 2048 --port 8011 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
      spid=$!
      wait_healthy
      for w in 1 2 3; do
        run first_wave_server_$w 60 python3 benchmarks/serving.py --base-url http://127.0.0.1:8011/v1 --concurrency 8 \
          --requests 8 --input-len 1024 --output-len 8 --vocab 200000 --warmup-requests 0 --seed $w \
          --out "$OUT/first_wave_server_$w.json"
        echo "wave $w: $(grep -c . "$OUT/server_steps.jsonl") timeline lines"
      done
      kill $spid; wait $spid 2>/dev/null
      for p in step1 step2 loop; do  # what the first wave's first steps and event loop did that the second's did not
        [ -f "$OUT/server_steps.jsonl.wave1.$p.prof" ] || continue  # Python 3.12: the steps' or the loop's
        python3 benchmarks/server_steps.py diff "$OUT/server_steps.jsonl.wave1.$p.prof" \
          "$OUT/server_steps.jsonl.wave2.$p.prof" | tee "$OUT/server_steps_diff_$p.txt" | head -14
      done ;;
    rebuild) run rebuild 300 python3 benchmarks/rebuild.py --config gemma-4-26b-a4b --builds 2 --out "$OUT/rebuild.json" ;;
    scoring) run scoring${SCORING_TAG:-} 300 python3 benchmarks/scoring.py --config ${SCORING_MODEL:-gemma-4-26b-a4b} \
               --prompt-len 4096 --out "$OUT/scoring${SCORING_TAG:-}.json" ;;  # e.g. SCORING_MODEL=qwen3.5-35b-a3b
                                                                              # SCORING_TAG=_qwen
    offline32) run offline32 300 python3 benchmarks/throughput.py --config gemma-4-26b-a4b --shapes 1024x32x256 \
                 --async-scheduling --warmup 1 --runs 2 --out "$OUT" ;;
    par_modes)  # issue 16, two GPUs: eager TP2 / PP2 / TP2+EP tokens vs one GPU on a tiny model, a worker killed mid-decode
      tiny_all; run par_modes 240 python3 scripts/check_parallel_gpu.py /tmp/ckpt_all modes ;;
    par_compiled) tiny_all; run par_compiled 400 python3 scripts/check_parallel_gpu.py /tmp/ckpt_all compiled ${PAR_MODES:-tp2,tp2ep,pp2} ;;
    par_kill) tiny_all; run par_kill 200 python3 scripts/check_parallel_gpu.py /tmp/ckpt_all kill_compiled ;;
    par_bf16) tiny_all; run par_bf16 400 python3 scripts/check_parallel_gpu.py /tmp/ckpt_all bf16 ${PAR_MODES:-tp1,tp2,tp2ep,pp2} ;;
    arnorm) run arnorm 150 python3 benchmarks/allreduce_norm.py --out "$OUT/allreduce_norm.json" ;;  # fused vs NCCL + norm
    arnorm_e2e)  # after arnorm: TP2 end to end with whichever all-reduce + norm the microbenchmark favoured at 8-32 rows
      pick=$(python3 -c "import json; d=json.load(open('$OUT/allreduce_norm.json'))['rows']
rows=[r for r in d if int(r) in (8, 16, 32)]
tot=lambda k: sum(d[r][k]['us'] if isinstance(d[r][k], dict) else d[r][k] for r in rows)
fused={k: tot(k) for k in d[rows[0]] if k.startswith('fused_')}
best=min(fused, key=fused.get)
print(best.split('_')[1] + ':' + best.split('_')[2][1:] + ':' + best.split('_')[3][1:] if fused[best] < tot('one_shot_then_norm_us') else 'symm-mem')")
      echo "arnorm_e2e: $pick"
      if [ "$pick" = symm-mem ]; then
        run tp2_tput_symm 330 python3 \
          benchmarks/throughput.py --config gemma-4-26b-a4b --shapes 1024x8x256,1024x32x256 --tensor-parallel-size 2 \
          --tp-allreduce symm-mem --op-providers allreduce_rms_norm=reference --warmup 1 --runs 2 --out "$OUT"
      else
        COMPILED_LLM_ALLREDUCE_NORM=$pick run tp2_tput_fused 330 python3 benchmarks/throughput.py --config gemma-4-26b-a4b \
          --shapes 1024x8x256,1024x32x256 --tensor-parallel-size 2 --warmup 1 --runs 2 --out "$OUT"
      fi ;;
    tp2_big) run tp2_big 330 python3 scripts/gpu_smoke.py --sections big --shape 1024x8x256 --tp 2 \
               --tp-allreduce ${TP_ALLREDUCE:-nccl} --out "$OUT/tp2_big" ;;  # sync vs async under TP, rank 0's profile
    tp2_tput) run tp2_tput 330 python3 benchmarks/throughput.py --config gemma-4-26b-a4b --shapes 1024x8x256,1024x32x256 \
                --tensor-parallel-size 2 --tp-allreduce ${TP_ALLREDUCE:-nccl} ${TP_ARGS:-} --warmup 1 --runs 2 --out "$OUT" ;;
    one_tput) run one_tput 330 python3 benchmarks/throughput.py --config gemma-4-26b-a4b --shapes 1024x8x256,1024x32x256 \
                --warmup 1 --runs 2 --out "$OUT" ;;  # the one-GPU side of tp2_tput, same call
    env) env | grep -E '^PYTHON' ; python3 -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in \
           ('fastapi', 'uvicorn', 'pydantic', 'openai', 'httpx', 'xgrammar', 'flashinfer')})" ;;
    warmstart)  # compile-cache build then hit on the 26B-A4B shapes, static bucket compiles vs none
      python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from configs import write_checkpoint_folder; write_checkpoint_folder('gemma-4-26b-a4b', Path('/tmp/g26'))"
      for cs in none default; do
        flag=$([ $cs = none ] && echo "--compile-sizes none" || echo "")
        for pass in build hit; do
          run warmstart_${cs}_$pass 280 python3 -m compiled_llm compile-cache --model /tmp/g26 --load-format dummy \
            --skip-tokenizer-init --max-model-len 8192 --max-num-seqs 8 --out /tmp/cc_$cs --report $flag
        done
      done ;;
    startup)  # 26B-A4B with serve's defaults (batch 8): a cold compile-cache build, then a start from a copy of
              # it in another folder (the relocated warm start of issue 15); each a fresh process, timed whole
      # (STARTUP_MODEL: another preset config; STARTUP_PROFILE=0 skips the profiled third start)
      sm=${STARTUP_MODEL:-gemma-4-26b-a4b}
      python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from configs import write_checkpoint_folder; write_checkpoint_folder('$sm', Path('/tmp/startup_model'))"
      args="--model /tmp/startup_model --load-format dummy --skip-tokenizer-init --max-num-seqs 8 --report ${STARTUP_ARGS:-}"
      rm -rf /tmp/cc_built /tmp/elsewhere/cc
      run startup_cold 300 python3 -m compiled_llm compile-cache $args --out /tmp/cc_built
      mkdir -p /tmp/elsewhere && cp -r /tmp/cc_built /tmp/elsewhere/cc
      run startup_warm 240 python3 -m compiled_llm compile-cache $args --out /tmp/elsewhere/cc
      # the warm start again under cProfile: where the seconds beyond loading go (issue 15: <= 10 s)
      [ "${STARTUP_PROFILE:-1}" = 0 ] && continue
      run startup_warm_profile 240 python3 -m cProfile -o "$OUT/warm.prof" -m compiled_llm compile-cache $args \
        --out /tmp/elsewhere/cc
      python3 -c "import pstats, sys; pstats.Stats('$OUT/warm.prof', stream=sys.stdout).sort_stats('tottime').print_stats(40); \
pstats.Stats('$OUT/warm.prof', stream=sys.stdout).sort_stats('cumulative').print_callers('builtins.compile'); \
pstats.Stats('$OUT/warm.prof', stream=sys.stdout).sort_stats('cumulative').print_stats('compiled_llm|_inductor|_dynamo/(eval_frame|convert_frame)|triton/compiler', 60)" \
        > "$OUT/startup_warm_profile.txt" 2>&1 && rm -f "$OUT/warm.prof" ;;
    startup_json)  # issue 15: benchmarks/startup.py, cold then relocated warm, phases into $OUT/startup_*.json
      run startup_json 300 python3 benchmarks/startup.py --config ${STARTUP_MODEL:-gemma-4-26b-a4b} --out "$OUT" \
        -- --max-num-seqs 8 ;;
    aot_tput)  # issue 15: decode throughput of the fast start (the forward loaded from a compile cache) against the
               # start that built that cache (its forward compiled ahead of time, used as it was built) and a start
               # without a compile cache (Dynamo, FX graphs): within 3%
      a="--config gemma-4-26b-a4b --shapes 1024x8x256 --async-scheduling --warmup 1 --runs 3 --out $OUT"
      run aot_build 300 python3 benchmarks/throughput.py $a --compile-cache /tmp/cc_tput
      run aot_load 200 python3 benchmarks/throughput.py $a --compile-cache /tmp/cc_tput
      run aot_none 300 python3 benchmarks/throughput.py $a ;;
    *) echo "unknown step $step" ;;
  esac
done
