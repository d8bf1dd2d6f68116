#!/usr/bin/env bash
# One GPU call's worth of the planned runs (experiments/gpu/README.md), each step under its own limit:
#   source experiments/gpu/env.sh && bash experiments/gpu/session.sh PART [NAME...]
# PART: tests [PATH...] | kernels [sweep | bench [OPS]] | train [METHOD SEQ_LEN BATCH [KEY=VALUE | LINEARIZE_*=VALUE | graph...]] | fsdp [BATCH [CASES]] (2 GPUs)
# | memory MODEL LAYERS (a real teacher's decode memory, 1K to 128K) | model [SHAPE [compile|eager [CONTEXTS/BATCHES, values joined by +, e.g. 1k+32k/1+64 [METHOD]]]]
# | rows NAME... (a recipe by name) | distill NAME... (the rows' training alone; a later `rows` evaluates)
# | routing ROW [KEY=VALUE...] (experiments/scripts/still_routing.py on a trained STILL row in /tmp/runs, its options) | mass ROW (its mass part
# alone: a Lizard row) | eval ROW TASKS LENGTHS KEY=VALUE... (a trained row under other inference options)
# | serve [SHAPE [PREFILL_BUDGET]] (bench serve) | servechat [SHAPE] (bench serve --scenario chat) | servehybrid [SHAPE] (a 50% hybrid batched and one at a time) | rowsstep (a batched softmax step by row count, profiled) | modelretrieval (the retrieval variants' speed beside Lizard, 8B) | trainshape SHAPE [SECONDS [LENGTHS [CHECKPOINTING]]] (bench train at an 8B shape) | promptsweep MODEL LENGTHS [SHAPES [SAMPLES]] (a teacher's prompt shapes) | teacher | after TAG (waits until the part tagged TAG has finished, e.g. `after fsdp`, then ends).
# Logs and results come back as one $OUT/PART[-NAME...].tgz (at most 8 files come back from a call);
# experiments/gpu/together.sh runs several parts at once, on one GPU or both.
set -uo pipefail
source experiments/gpu/step.sh
part=${1:?part}
shift
# "=" would keep the archive from coming back (the device tool refuses odd names).
tag=$(IFS=-; echo "$part${*:+-$*}" | tr '=/,+' '____')
export LOGS=/tmp/res/$tag
res=$LOGS
mkdir -p "$res"
case $part in
  tests)
    # PATH words narrow the run to those test files (the whole GPU set takes ~5 minutes); pytest
    # options may follow, with + for the spaces of one (a part's words split at spaces):
    # `tests tests/kernels -k own-blocks+or+bf16`.
    paths=("${@//+/ }")
    [ ${#paths[@]} -eq 0 ] && paths=(tests/test_gpu.py tests/kernels tests/ops tests/serve tests/train/test_step.py tests/train/test_layer_selection.py
      tests/train/test_multirank.py)
    step tests 540 python -m pytest -q -m gpu "${paths[@]}" -p no:cacheprovider ;;
  kernels)
    # `kernels sweep`: the block configurations at L = 2K, each profiled; `kernels forward`: the forward
    # alone at the forward sweep's rows, B=16 L=2K and B=32 L=8K, and fla chunk_simple_gla's; `kernels states
    # [L B]`: the forward state pass alone at each block, warps and stages (B=32 L=8K); `kernels host`: our forward's
    # time split between the host and the GPU (events, host, CUDA graph replay); `kernels features`: the
    # features kernel alone at the 8B shape, L = 16K (weights bf16 or float32, programs walking blocks or
    # one a block); `kernels still-blocks [CONTEXTS [BLOCKS [TILES]]]`: STILL's 8B-shape prefill under each
    # kernel block size and forward tiling (experiments/scripts/time_still_block.py, values joined by +); `kernels bench [OPS]`: `bench
    # kernels` (Table 3: every shape, every op or the ops OPS names joined by +, into the docs' format;
    # fla's kernels take ~6 minutes to compile and tune on a cold machine); no word: the check's timings.
    case ${1:-} in
      sweep) step sweep 300 python -m experiments.kernel_check --no-check --no-bench --sweep --lengths 2048 \
               --profile "$res/profile" ;;
      forward) step forward 480 python -m experiments.kernel_check --no-check --no-bench --sweep-forward \
                 --lengths 2048 8192 8192 --batches 16 16 32 ;;
      host) step host 120 python -m experiments.kernel_check --no-check --no-bench --host ;;
      features) step features 120 python -m experiments.kernel_check --no-check --no-bench --sweep-features \
                  --lengths 16384 ;;
      still-blocks) contexts=${2:-16k}
                    blocks=${3:-8192+4096+2048+1024}
                    tiles=${4:-32x32/4/3+64x32/8/3+64x64/8/2+128x32/8/3}  # beside the kernel's own tiles (forward_launch)
                    step still_blocks 400 python -m experiments.scripts.time_still_block --contexts "${contexts//+/,}" \
                      --blocks "${blocks//+/,}" --tiles "${tiles//+/,}" ;;
      states) step states 480 python -m experiments.kernel_check --no-check --no-bench --sweep-states \
                --lengths "${2:-8192}" --batches "${3:-32}" ;;
      bench) ops=()
             [ -n "${2:-}" ] && ops=(--ops "${2//+/,}")
             step bench 540 python -m linearize.cli bench kernels "${ops[@]}" --out "$res/kernels" ;;
      *) step check 300 python -m experiments.kernel_check --no-check ;;
    esac ;;
  train)
    # KEY=VALUE words set method options; LINEARIZE_*=VALUE words set that environment variable for
    # this part alone (e.g. LINEARIZE_BACKEND=torch for an A/B timing).
    # The word "graph" replays each step from a CUDA graph (--cuda-graph).
    sets=()
    envs=()
    for option in "${@:4}"; do
      case $option in
        LINEARIZE_*=*) envs+=("$option") ;;
        graph) sets+=(--cuda-graph) ;;
        *) sets+=(--set "$option") ;;
      esac
    done
    step train 200 env "${envs[@]}" python -m linearize.cli bench train --model smollm2 --method "${1:-lizard}" \
      --seq-len "${2:-2048}" --batch "${3:-8}" "${sets[@]}" --profile --out "$res/train" ;;
  after)
    while [ ! -f "$OUT/$1.tgz" ] && [ "$(date +%s)" -lt "${DEADLINE:-0}" ]; do sleep 5; done
    exit ;;
  fsdp)
    # An optional word sets the global batch (16 by default), a second the cases
    # joined by + (all of fsdp_check.py's by default), e.g. `fsdp 16 graphed`.
    cases=${2:-fsdp+gathered+replicated+graphed}
    step fsdp 540 python experiments/gpu/fsdp_check.py --gpus 2 --steps 16 --batch "${1:-16}" --cases "${cases//+/,}" \
      --out "$res/fsdp" ;;
  model)
    # The best Lizard (recipes/ablations/lizard-rope-shared.yaml), or METHOD with its defaults, each
    # prefilling in 16K-token calls that continue its cache, beside the GEMM floor; at the 8B
    # shape the batch sweep runs at the 32K context that the decode target names.
    shape=${1:-llama3-8b}
    method=${4:-lizard}
    extra=(--methods "$method")
    [ "$method" = lizard ] && extra+=(--set combine=shared --set rope_in_window=true)
    [ "$shape" = llama3-8b ] && extra+=(--batch-context 32k --batches 1,16,64)
    [ "${2:-}" = compile ] && extra+=(--compile-decode)
    # A third word narrows the sweep: CONTEXTS/BATCHES with + between values (together.sh splits
    # parts at commas), e.g. 1k+32k/1+64.
    if [ -n "${3:-}" ]; then
      contexts=${3%/*}
      batches=${3#*/}
      extra+=(--contexts "${contexts//+/,}" --batches "${batches//+/,}")
    fi
    # Further LINEARIZE_*=VALUE words set that environment variable for this part alone, e.g.
    # LINEARIZE_BACKEND=torch to time the PyTorch forms (STILL's blocked prefill) against the kernels.
    envs=("${@:5}")
    step "model_$shape" 500 env "${envs[@]}" python -m linearize.cli bench model --shape "$shape" "${extra[@]}" \
      --profile --time-limit 460 --out "$res/model-$shape" ;;
  serve)
    # `bench serve` at a shape (default llama3-8b), the best Lizard against the batched teacher; a
    # second word B: only 64 clients with 4K prompts (the inter-token latency target), at
    # --prefill-budget B (a point still running at its model's share of the time limit is cut, with
    # what had arrived).
    pace=()
    [ -n "${2:-}" ] && pace=(--clients 64 --prompt-lengths 4k --prefill-budget "$2")
    step "serve_${1:-llama3-8b}" 570 python -m linearize.cli bench serve --shape "${1:-llama3-8b}" --set combine=shared \
      --set rope_in_window=true "${pace[@]}" --time-limit 540 --out "$res/serve-${1:-llama3-8b}" ;;
  servechat)
    # `bench serve --scenario chat` at a shape (default llama3-8b): 8 conversations of 6 turns growing to
    # 32K tokens, the best Lizard with its prefix cache on and off against the batched teacher.
    step "servechat_${1:-llama3-8b}" 570 python -m linearize.cli bench serve --scenario chat --shape "${1:-llama3-8b}" \
      --set combine=shared --set rope_in_window=true --time-limit 540 --out "$res/serve-chat-${1:-llama3-8b}" ;;
  servehybrid)
    # The hybrid serving target: a 50% Lizard hybrid (16 of the 8B shape's 32 layers softmax, evenly
    # spaced) at 16 clients x 4K prompts, in one batch and then one request at a time (`--max-batch 1`).
    for batch in 256 1; do
      step "servehybrid_${1:-llama3-8b}_$batch" 280 python -m linearize.cli bench serve --shape "${1:-llama3-8b}" \
        --softmax-layers even:16 --clients 16 --prompt-lengths 4k --max-batch "$batch" --set combine=shared \
        --set rope_in_window=true --time-limit 260 --out "$res/serve-hybrid-${1:-llama3-8b}-max-batch-$batch"
    done ;;
  modelretrieval)
    # The retrieval target's speed row: Lizard with its delta memory (own decay) and with a 64-slot sparse
    # cache beside plain Lizard, at the 8B shape, prefill to 32K at batch 1 and decode at batches 1 and 64.
    step modelretrieval 570 python -m linearize.cli bench model --shape llama3-8b --set combine=shared \
      --set rope_in_window=true --variant lizard-delta=lizard:memory=delta,memory_decay_init=0.9995 \
      --variant lizard-sparse=lizard:sparse_slots=64 --contexts 4k,16k,32k --batches 1,64 --time-limit 540 \
      --out "$res/model-retrieval-llama3-8b" ;;
  rowsstep)
    # Where a batched step of softmax rows goes (experiments/serve/rows_step.py): the 50% hybrid and the
    # teacher at the 8B shape, 1 to 16 rows of 4K tokens, profiled at 16.
    step rowsstep_hybrid 240 python -m experiments.serve.rows_step --rows 1,4,16 --out "$res/rows-step-hybrid"
    step rowsstep_teacher 240 python -m experiments.serve.rows_step --teacher --rows 1,4,16 --out "$res/rows-step-teacher" ;;
  trainshape)
    # `bench train` at a shape (llama3-8b, mistral-7b, qwen3-8b): the LoRA reference, stages 1 and 2,
    # 2K and 8K, checkpointing on and off, the best Lizard. Further words narrow it to what is left of a
    # session's device time: the run's time limit in seconds (default 540), the lengths (joined by +)
    # and checkpointing (on, off or both), e.g. `trainshape llama3-8b 300 2k on`.
    lengths=${3:-2k+8k}
    step "train_$1" 570 python -m linearize.cli bench train --shape "${1:?shape}" --set combine=shared \
      --set rope_in_window=true --time-limit "${2:-540}" --seq-lens "${lengths//+/,}" \
      --gradient-checkpointing "${4:-both}" --out "$res/train-$1" ;;
  memory)
    # A real teacher's decode memory and speed by context (`memory gemma3 full`): the best Lizard on its
    # layers LAYERS (all or full) beside the teacher, 1K to 128K at batch 1.
    step "memory_$1_$2" 500 python -m linearize.cli bench model --model "${1:?model}" --layers "${2:?layers}" \
      --methods lizard --set combine=shared --set rope_in_window=true --contexts 1k,2k,4k,8k,16k,32k,64k,128k \
      --batches 1 --time-limit 460 --out "$res/memory-$1-$2" ;;
  rows|distill)
    # KEY=VALUE words override the recipes' settings, + for commas (together.sh splits parts at commas):
    # `rows lizard-window-256-delta eval.tasks=ppl+passkey`.
    recipes=()
    names=()
    for word in "$@"; do
      if [[ $word == *=* ]]; then recipes+=("${word//+/,}"); else recipes+=("$word"); names+=("$word"); fi
    done
    set -- "${names[@]}"
    only=()
    [ "$part" = distill ] && only=(--no-eval)
    # Under background.sh, the set's rows so far: its polls bring back these runs, not a set's beside it.
    [ -n "${ROWS_FILE:-}" ] && printf '%s\n' "$@" >> "$ROWS_FILE"
    step "$part" 570 python -m linearize.cli recipe run "${recipes[@]}" "${only[@]}" --out /tmp/runs
    # The runs stay in /tmp/runs (a later call on a warm machine resumes them); weights and checkpoints
    # stay there, the training logs come back.
    runs=()
    for name in "$@"; do [ -d "/tmp/runs/$name" ] && runs+=(-C /tmp/runs "$name"); done
    tar czf "$OUT/$tag.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=checkpoint --exclude='*.gguf' \
      -C /tmp/res "$tag" "${runs[@]}"
    exit ;;
  routing)
    # Where the row's own q and k route the passkey, under each routing variant of the script, and
    # how much of the question's attention the key gets beside the linear state. KEY=VALUE words
    # become the script's options, + for commas: `routing ROW task=niah_single variant=3 lengths=1k+4k configs=2`.
    flags=()
    for option in "${@:2}"; do flags+=("--${option%%=*}" "${option#*=}"); done
    flags=("${flags[@]//+/,}")
    step routing 300 python -m experiments.scripts.still_routing --model "/tmp/runs/${1:?row}/model" "${flags[@]}" \
      --out "$res/routing" ;;
  mass)
    step mass 300 python -m experiments.scripts.still_routing --parts mass --model "/tmp/runs/${1:?row}/model" --out "$res/mass" ;;
  eval)
    # TASKS and LENGTHS joined by + (together.sh splits parts at commas), e.g.
    # `eval still-seq4096 passkey+niah_single 1k+2k+4k+8k budget=6272 max_chunks=128`; as the recipes evaluate.
    sets=()
    for option in "${@:4}"; do sets+=(--set "$option"); done
    tasks=${2:?tasks}
    lengths=${3:?lengths}
    step eval 500 python -m linearize.cli eval --model "/tmp/runs/${1:?row}/model" --tasks "${tasks//+/,}" \
      --lengths "${lengths//+/,}" --batch 32 --dtype bfloat16 "${sets[@]}" --out "$res/eval.json" ;;
  promptsweep)
    # A teacher's retrieval under each prompt shape (experiments/retrieval/prompt_sweep.py), + for commas:
    # `promptsweep gemma3 4k+8k+16k+32k v1+space+landmark 3`.
    lengths=${2:?lengths}
    shapes=${3:-v1+space+landmark}
    step promptsweep 570 python experiments/retrieval/prompt_sweep.py --model "${1:?model}" --device cuda \
      --dtype bfloat16 --lengths "${lengths//+/,}" --shapes "${shapes//+/,}" --samples "${4:-3}" \
      --out "$res/sweep.json"
    tar czf "$OUT/$tag.tgz" -C /tmp/res "$tag"
    exit ;;
  teacher)
    step teacher 570 bash experiments/gpu/teacher_eval.sh "$res/teacher" mmlu longcontext ;;
  *)
    echo "unknown part $part" >&2
    exit 2 ;;
esac
tar czf "$OUT/$tag.tgz" -C /tmp/res "$tag"
