#!/usr/bin/env bash
# One call on a GPU machine: the GPU test suite, then the benchmarks, logs under $OUT and a
# short table last; the logs come back as $OUT/logs-MODE.tgz. Usage: bash benchmarks/gpu_run.sh
# [tests|tests-1|tests-2|tests-3|bench|all|kernels|serve|dp|tp|tp-ab|tp-profile|multinode|hybrid|
# hybrid-bench|hybrid-prefix|moe-bench|moe-tp|moe-ep|fp8-bench|fp8-moe|baseline] (default: all;
# baseline: the torch reference attention, eager, for comparison; dp, tp, tp-ab, multinode,
# moe-tp and moe-ep need two GPUs; NO_TESTS=1 skips dp's tests; DP_PROFILE=1 samples dp's engine
# processes with py-spy, whose wheel gpu-wheels.sh fetches: py-spy==0.4.3)
# Expects the wheels of ../shared/tools/gpu-wheels.sh in .whl/ (pyrsistent is missing there),
# and flash-attn-4 in /tmp/fa4site if it is to be tested and measured (benchmarks/fa4_install.sh);
# set NANOFN_COMMIT to the commit being measured (the device copy has no .git).
# serve also needs the server's wheels (and structured output llguidance's, whose platform tag
# gpu-wheels.sh does not ask for):
#   ../shared/tools/gpu-wheels.sh fastapi==0.165.0 uvicorn==0.54.0 starlette==1.10.0 \
#     pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 annotated-doc==0.0.7 \
#     typing-inspection==0.4.5 opentelemetry-api==1.45.2 prometheus_client==0.26.0 \
#     openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore jiter==0.19.0 sniffio==1.3.1 \
#     anyio==4.16.0 h11==0.16.0 click==8.5.1 distro typing_extensions==4.16.0 idna==3.20 \
#     uvloop==0.23.0 httptools==0.9.0
# the hybrids (tests-2, hybrid*) need flash-linear-attention too:
#   ../shared/tools/gpu-wheels.sh fla-core==0.6.0 einops==0.8.1
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1
set -u
what=${1:-all}
OUT=${OUT:-/tmp/nanofn-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NANOFN_CACHE=/tmp/nanofn-cache
# NVLink multicast off (issue 37): NCCL's NVLS and torch's symmetric-memory multicast can take
# the host's GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ -d /tmp/fa4site ]; then  # flash-attn-4, installed by benchmarks/fa4_install.sh
  export PYTHONPATH=/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH:/tmp/fa4site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "${NANOFN_COMMIT:-unknown commit}" | tee "$OUT/commit.txt"  # the device copy has no .git

case $what in  # the whole suite outgrew one call's 600 s: tests-1, -2 and -3 split it
  tests|all) suite=(tests/gpu) ;;
  # (pytest's own times on an H100, 782bbb7: 269, 264 and 141 s; ~400 s for tests-2 on a
  # fresh H200 before)
  tests-1) suite=(tests/gpu/test_[a-g]*.py) ;;  # flash-attn-4, clean runs, the engine, FP8
  tests-2) suite=(tests/gpu/test_[h-m]*.py) ;;  # hybrids, MoE, two GPUs
  tests-3) suite=(tests/gpu/test_[n-z]*.py) ;;  # the Triton kernels
  *) suite=() ;;
esac
if [ ${#suite[@]} -gt 0 ]; then  # (a test past 300 s fails alone, its stacks dumped)
  timeout 480 python3 -m pytest "${suite[@]}" -q -rs --durations=12 --timeout 300 \
    --timeout-method=thread 2>&1 | tee "$OUT/gpu_$what.log" | tail -40
fi
bench() {  # name, then nanofn bench flags
  local name=$1; shift
  timeout 300 python3 -m nanofn bench --random-weights qwen3-0.6b --max-model-len 4096 \
    --json "$OUT/bench-$name.json" "$@" 2>&1 | tee "$OUT/bench-$name.log" | tail -8
}
single() {  # name, then LLM options
  local name=$1; shift
  timeout 150 python3 benchmarks/single_request.py --random-weights qwen3-0.6b \
    --json "$OUT/single-$name.json" "$@" 2>&1 | tee "$OUT/single-$name.log" | tail -3
}
if [ "$what" = bench ] || [ "$what" = all ]; then
  bench triton-graphs --profile
  bench triton-graphs-again --profile
  bench shared-prefix --workload shared-prefix --profile
  single triton-graphs --trace "$OUT/prefill"
  single no-overlap --no-overlap  # kernels launched one after another, for a before/after
  timeout 120 python3 benchmarks/profile_prefill.py --random-weights qwen3-0.6b \
    > "$OUT/profile-prefill.txt" 2>&1
  grep "one prefill step" "$OUT/profile-prefill.txt"
  for b in 1 256; do
    timeout 120 python3 benchmarks/profile_decode.py --random-weights qwen3-0.6b --batch $b \
      --host-only > "$OUT/profile-$b.txt" 2>&1
    grep -A1 "per decode step" "$OUT/profile-$b.txt"
  done
fi
if [ "$what" = kernels ]; then
  for f in tests/gpu/test_triton_attention_gpu.py tests/gpu/test_flash_attention_gpu.py \
           tests/gpu/test_triton_ops_gpu.py tests/gpu/test_triton_gemv_gpu.py \
           tests/gpu/test_triton_sampling_gpu.py; do
    timeout 120 python3 "$f" 2>&1 | tee -a "$OUT/kernels.txt" | tail -15
  done
fi
if [ "$what" = tp ]; then  # two GPUs: TP=2 parity, worker faults, TP=1 and TP=2 on a larger shape
  timeout 240 python3 -m pytest tests/gpu/test_gpu_engine.py tests/gpu/test_multi_gpu.py -q -rs \
    -k "tensor_parallel or peer" 2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -5
  # the all-reduce at decode sizes: NCCL against peer memory
  timeout 120 python3 benchmarks/experiments/all_reduce.py 2>&1 | tee "$OUT/all_reduce.txt"
  # a worker killed or stopped mid-generate, on NCCL here (pytest-timeout dumps the stacks
  # from a thread of its own: a main thread stuck inside NCCL never sees a signal)
  timeout 300 python3 -m pytest tests/test_tensor_parallel_faults.py -q -rs --timeout 100 --timeout-method=thread 2>&1 \
    | tee "$OUT/gpu_tp_faults.log" | tail -30
  bench qwen3-8b-tp1 --random-weights qwen3-8b --profile
  bench qwen3-8b-tp2 --random-weights qwen3-8b --tensor-parallel-size 2 --profile
  bench qwen3-8b-tp2-nccl --random-weights qwen3-8b --tensor-parallel-size 2 \
    --disable-custom-all-reduce
  # every worker is a spawned process: none may outlive the runs above
  echo "worker processes left: $(pgrep -fc multiprocessing.spawn)" | tee "$OUT/tp_leftover.txt"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a "$OUT/tp_leftover.txt"
fi
if [ "$what" = tp-ab ]; then  # two GPUs: TP=2 of a base tree (.ab_base, as ab_trees.sh makes
  # one) against this one in one lease, the trees in turn (ROUNDS, default 1), and the sums
  timeout 200 python3 -m pytest tests/gpu/test_multi_gpu.py -q -rs -k "peer or two_ranks" \
    --timeout 100 --timeout-method=thread 2>&1 | tee "$OUT/gpu_tp_ab_tests.log" | tail -5
  timeout 120 python3 benchmarks/experiments/all_reduce.py 2>&1 | tee "$OUT/all_reduce.txt"
  for round in $(seq 1 "${ROUNDS:-1}"); do
    for tree in .ab_base .; do
      name=$([ "$tree" = . ] && echo this || echo base)
      (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m nanofn bench \
        --random-weights qwen3-8b --max-model-len 4096 --tensor-parallel-size 2 --profile \
        --json "$OUT/bench-tp2-$name-$round.json" > "$OUT/bench-tp2-$name-$round.log" 2>&1)
      echo "$name (round $round): $(grep -E '^elapsed|^device busy' "$OUT/bench-tp2-$name-$round.log" | tr '\n' ' ')"
    done
  done
fi
if [ "$what" = serve ]; then  # needs fastapi, uvicorn, prometheus_client, openai wheels in .whl/
  model=$(python3 -c "from nanofn.model.tiny import random_weights_model as r; print(r('qwen3-0.6b'))")
  python3 -m nanofn serve "$model" --load-format dummy --port 8011 --max-model-len 4096 > "$OUT/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 1 240); do curl -sf localhost:8011/health > /dev/null && break; sleep 1; done
  timeout 300 python3 benchmarks/serve.py --url http://127.0.0.1:8011 --requests 256 \
    --concurrency 64 --prompt-len 512 --max-tokens 256 --json "$OUT/serve.json" \
    | tee "$OUT/serve.txt"
  kill -TERM $server; wait $server
fi
if [ "$what" = dp ]; then  # two GPUs: serve --data-parallel-size 2 against one replica
  if [ -z "${NO_TESTS:-}" ]; then
    timeout 200 python3 -m pytest tests/gpu/test_multi_gpu.py -q -rs -k data_parallel 2>&1 \
      | tee "$OUT/gpu_dp_tests.log" | tail -5
  fi
  model=$(python3 -c "from nanofn.model.tiny import random_weights_model as r; print(r('qwen3-0.6b'))")
  # 256 streams a replica (one replica also at 512, to show where it saturates), each token
  # streamed as it comes and 8 at a time (--stream-interval), through --api-server-count HTTP
  # processes (default: one a replica); the CPU seconds of the HTTP side (the server's
  # processes but the engines) and of the engines after each run tell which one is the bound.
  # DP_RUNS: replicas:streams:interval[:HTTP processes] runs
  cpu_s() {  # CPU seconds of the server's processes: http (all but the engines) or engine
    local total=0 p
    for p in $server $(pgrep -P $server); do
      [ "$(cat /proc/$p/comm)" = nanofn-engine ] && [ $1 = http ] && continue
      [ "$(cat /proc/$p/comm)" != nanofn-engine ] && [ $1 = engine ] && continue
      total=$((total + $(ps -o times= -p $p)))
    done
    echo $total
  }
  for run in ${DP_RUNS:-1:256:1:1 1:256:1:4 2:512:1:2 2:512:1:8 1:256:8:1 2:512:8:2}; do
    IFS=: read -r dp streams interval api <<< "$run"
    api=${api:-$dp}; name=dp$dp-c$streams-i$interval-a$api; port=$((8020 + dp))
    python3 -m nanofn serve "$model" --load-format dummy --port $port --max-model-len 4096 \
      --data-parallel-size $dp --stream-interval $interval --api-server-count $api \
      > "$OUT/serve-$name.log" 2>&1 &
    server=$!
    for _ in $(seq 1 240); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
    http_before=$(cpu_s http); engine_before=$(cpu_s engine)
    if [ -n "${DP_PROFILE:-}" ]; then  # where the engine processes' host time goes (py-spy's
      # wheel in .whl/; reading another process needs ptrace: a log line says if refused)
      for p in $(pgrep -P $server); do
        [ "$(cat /proc/$p/comm)" = nanofn-engine ] || continue
        /tmp/site/bin/py-spy record --pid $p --duration 8 --rate 100 --nonblocking --format raw \
          -o "$OUT/pyspy-$name-$p.txt" > "$OUT/pyspy-$name-$p.log" 2>&1 &
      done
    fi
    timeout 300 python3 benchmarks/serve.py --url http://127.0.0.1:$port \
      --requests $((4 * streams)) --concurrency $streams --prompt-len 512 --max-tokens 256 \
      --json "$OUT/serve-$name.json" | tee "$OUT/serve-$name.txt"
    echo "CPU s during the run: HTTP processes $(( $(cpu_s http) - http_before )), engines" \
      "$(( $(cpu_s engine) - engine_before ))" | tee -a "$OUT/serve-$name.txt"
    curl -s localhost:$port/metrics | grep -E '^nanofn:sequences_finished_total' \
      | tee -a "$OUT/serve-$name.txt"  # per replica and summed
    kill -TERM $server; wait $server
  done
  for f in "$OUT"/pyspy-*.txt; do  # the frames the engine processes were in most, inclusive
    [ -f "$f" ] && python3 - "$f" <<'PY'
import collections, sys
inclusive, total = collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, count = line.rsplit(" ", 1)
    total += int(count)
    for frame in set(stack.split(";")):
        inclusive[frame] += int(count)
print(f"== {sys.argv[1]}: {total} samples")
for frame, count in inclusive.most_common(30):
    print(f"{count / total:6.1%} {frame[:150]}")
PY
  done
  # the engine alone, the same requests through LLM.generate: what one replica could serve
  timeout 200 python3 - "$model" <<'PY' | tee "$OUT/offline-c256.txt"
import random, sys, time
from nanofn import LLM, SamplingParams
llm = LLM(sys.argv[1], load_format="dummy", max_model_len=4096, max_num_seqs=256)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(512)]} for _ in range(1024)]
params = SamplingParams(temperature=0.6, max_tokens=256, ignore_eos=True)
llm.generate(prompts[:64], params, use_tqdm=False)
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
took = time.perf_counter() - start
print(f"LLM.generate, 1024 requests, 256 at a time: {took:.2f} s, {1024 * 256 / took:,.0f} output tok/s")
PY
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {f.stem.removeprefix("serve-"): json.loads(f.read_text())["output_tok_s"]
        for f in sorted(out.glob("serve-dp*.json"))}
print(", ".join(f"{n} {v:,.0f} output tok/s" for n, v in runs.items()))
for interval, http in ((1, 1), (1, 4), (8, 1)):
    one = runs.get(f"dp1-c256-i{interval}-a{http}")
    two = runs.get(f"dp2-c512-i{interval}-a{2 * http}")
    if one and two:
        print(f"--stream-interval {interval}, {http} HTTP processes a replica: two replicas at "
              f"256 streams each {two / one:.2f}x one at 256 (goal: 1.85x)")
PY
fi
if [ "$what" = tp-profile ]; then  # a decode step of the 8B shape: TP=1 against one rank of 2
  for batch in 256 64; do
    for run in "tp1" "rank-of-2 --one-rank-of 2"; do
      set -- $run; name=$1; shift
      timeout 200 python3 benchmarks/profile_decode.py --random-weights qwen3-8b "$@" \
        --batch $batch --prompt-len 800 --timeline > "$OUT/profile-$name-$batch.txt" 2>&1
      echo "== $name, batch $batch"; grep -E "per decode step|critical path" "$OUT/profile-$name-$batch.txt"
      grep -A12 "critical us/step" "$OUT/profile-$name-$batch.txt"
    done
  done
fi
if [ "$what" = multinode ]; then  # two GPUs as two "hosts" of one GPU each, against TP=2
  timeout 300 python3 -m pytest tests/gpu/test_multi_gpu.py -q -rs -k hosts 2>&1 \
    | tee "$OUT/gpu_multinode_tests.log" | tail -5
  # against TP=2 on NCCL alone: across hosts no all-reduce goes through peer memory
  bench qwen3-8b-tp2-nccl --random-weights qwen3-8b --tensor-parallel-size 2 \
    --disable-custom-all-reduce
  CUDA_VISIBLE_DEVICES=1 python3 -m nanofn worker --tensor-parallel-size 2 --nnodes 2 \
    --node-rank 1 --master-addr 127.0.0.1 --master-port 29517 > "$OUT/worker-node1.log" 2>&1 &
  worker=$!
  CUDA_VISIBLE_DEVICES=0 bench qwen3-8b-tp2-two-hosts --random-weights qwen3-8b \
    --tensor-parallel-size 2 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29517
  wait $worker; echo "worker host exit code $?" | tee -a "$OUT/worker-node1.log"
fi
if [ "$what" = hybrid ] || [ "$what" = hybrid-bench ]; then  # Qwen3.5 (needs fla-core, einops)
  if [ "$what" = hybrid ]; then
    timeout 300 python3 -m pytest tests/gpu/test_hybrid_gpu.py -q -rs 2>&1 \
      | tee "$OUT/gpu_hybrid_tests.log" | tail -15
  fi
  # a linear layer's decode step: one launch per chunk and warp count, against four kernels
  timeout 180 python3 benchmarks/experiments/delta_rule_decode.py --seqs 16,64,256 2>&1 \
    | tee "$OUT/delta_rule_decode.txt" | tail -60
  single qwen3.5-9b --random-weights qwen3.5-9b-shape
  bench qwen3.5-9b --random-weights qwen3.5-9b-shape --profile
fi
if [ "$what" = moe-bench ]; then  # Qwen3-30B-A3B's shape: 61 GB of weights, ~10 GB of KV on an H100
  single qwen3-30b-a3b --random-weights qwen3-30b-a3b
  bench qwen3-30b-a3b --random-weights qwen3-30b-a3b --profile
fi
if [ "$what" = moe-tp ]; then  # two GPUs: the MoE shapes split over two ranks (issue 35)
  single qwen3-30b-a3b-tp2 --random-weights qwen3-30b-a3b --tensor-parallel-size=2
  bench qwen3-30b-a3b-tp1 --random-weights qwen3-30b-a3b --profile
  bench qwen3-30b-a3b-tp2 --random-weights qwen3-30b-a3b --tensor-parallel-size 2 --profile
  bench qwen3.5-35b-a3b-tp2 --random-weights qwen3.5-35b-a3b --tensor-parallel-size 2 --profile
fi
if [ "$what" = moe-ep ]; then  # two GPUs: expert parallelism against TP at TP=2 (issue 35)
  timeout 200 python3 -m pytest tests/gpu/test_multi_gpu.py tests/gpu/test_moe_gpu.py -q -rs \
    -k expert_parallel 2>&1 | tee "$OUT/gpu_moe_ep_tests.log" | tail -3
  for flags in "" "--enable-expert-parallel=true"; do
    single "qwen3-30b-a3b-tp2${flags:+-ep}" --random-weights qwen3-30b-a3b \
      --tensor-parallel-size=2 $flags
  done
  for flags in "" "--enable-expert-parallel"; do
    bench "qwen3-30b-a3b-tp2${flags:+-ep}" --random-weights qwen3-30b-a3b \
      --tensor-parallel-size 2 $flags --profile
  done
fi
if [ "$what" = fp8-bench ]; then  # FP8 weights and KV cache (issue 36), beside bf16 for the 8B
  single qwen3-0.6b-fp8 --quantization=fp8 --kv-cache-dtype=fp8
  bench qwen3-0.6b-fp8 --quantization fp8 --kv-cache-dtype fp8 --profile
  single qwen3-8b-bf16 --random-weights qwen3-8b
  single qwen3-8b-fp8 --random-weights qwen3-8b --quantization=fp8 --kv-cache-dtype=fp8
  bench qwen3-8b-fp8 --random-weights qwen3-8b --quantization fp8 --kv-cache-dtype fp8
  bench qwen3-8b-bf16 --random-weights qwen3-8b
  for shape in qwen3-0.6b qwen3-8b; do  # greedy tokens and log-probabilities against bf16
    timeout 200 python3 benchmarks/fp8_agreement.py --random-weights $shape \
      --json "$OUT/agreement-$shape.json" 2>&1 | tee "$OUT/agreement-$shape.txt" | tail -3
  done
fi
if [ "$what" = fp8-moe ]; then  # FP8 experts, weight-only (issue 36), beside bf16's 30B-A3B
  timeout 200 python3 -m pytest tests/gpu/test_moe_gpu.py tests/gpu/test_fp8_gpu.py -q -rs \
    -k "fp8_experts or (engine_with_fp8 and moe)" 2>&1 | tee "$OUT/gpu_fp8_moe_tests.log" | tail -3
  single qwen3-30b-a3b-fp8 --random-weights qwen3-30b-a3b --quantization=fp8
  single qwen3-30b-a3b-bf16 --random-weights qwen3-30b-a3b
  bench qwen3-30b-a3b-fp8 --random-weights qwen3-30b-a3b --quantization fp8 --profile
  bench qwen3-30b-a3b-bf16 --random-weights qwen3-30b-a3b --profile
fi
if [ "$what" = hybrid-prefix ]; then  # the shared-prefix workload, prefix caching on and off
  bench qwen3.5-9b-shared-prefix --random-weights qwen3.5-9b-shape --workload shared-prefix
  bench qwen3.5-9b-shared-prefix-off --random-weights qwen3.5-9b-shape --workload shared-prefix \
    --no-prefix-caching
fi
if [ "$what" = baseline ]; then
  single torch-eager --kernel-backend=torch --enforce-eager=true
  bench torch-eager --kernel-backend torch --enforce-eager
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("\n| run | elapsed s | output tok/s | fraction of floor |")
print("|---|---|---|---|")
for f in sorted(out.glob("bench-*.json")):
    d = json.loads(f.read_text())
    idle = d.get('device_idle_fraction')
    busy = d.get('device_busy_s')
    extra = f" (device busy {busy:.2f} s, GPU idle {idle:.1%})" if busy else ""
    print(f"| {f.stem} | {d.get('elapsed_s', 0):.2f}{extra} | {d.get('output_tok_s', 0):,.0f} | {d.get('fraction_of_floor', 0):.1%} |")
for f in sorted(out.glob("single-*.json")):
    d = json.loads(f.read_text())
    print(f"| {f.stem} | prefill {d['prefill_ms']:.0f} ms | {d['decode_tok_s']:,.0f} | {d['fraction_of_floor']:.1%} |")
PY
# At most 8 files come back from a device call: this run's logs travel in one archive each
# (logs-MODE.tgz; earlier runs' archives in the same call are left as they are).
(cd "$OUT" && tar czf "/tmp/logs-$what.tgz" --exclude='logs-*.tgz' . \
  && find . -type f ! -name 'logs-*.tgz' -delete && mv "/tmp/logs-$what.tgz" .)
