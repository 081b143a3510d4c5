#!/usr/bin/env bash
# The GPU measurements behind benchmarks/RESULTS.md, packed for one device call (H200 machine, repo root).
#
#   bash benchmarks/gpu_suite.sh OUTDIR JOB[,JOB...] [JOB[,JOB...]]
#
# Each argument after OUTDIR is a lane: its comma-separated jobs run one after another on one GPU
# (lane i on GPU i), lanes run side by side. Jobs and their time caps (seconds, env overridable):
#   step      bench_step.py: hf, liger, fasttune (offload / recompute / auto in 80 GiB), unsloth;
#             bf16 and NF4; 4x2048 and 1x8192 (more flags: STEP_ARGS)           STEP_S=540
#   kernels   bench_kernels.py, with the RoPE launch sweep unless KERNELS_ARGS="" KERNELS_S=90
#   tests     pytest -m gpu (every suite: 93 tests in 528 s on an H100; 109 in 209 s with three pytest-xdist workers,
#             used when the xdist wheel is carried), then the fused-LoRA/checkpointing files
#             without the marker                                                 TESTS_S=560 (+60)
#   fp8q      fp8_quality.py on the 0.54B model: FP8Q_SEEDS (3) adapter seeds per arm, the shipped FP8
#             path and its ablations (FP8Q_VARIANTS=fp8,fp8-fwd,fp8-bwd,fp8-w)   FP8Q_S=570
#   generate  bench_generate.py: bf16 and bf16+LoRA, batch 1 and 8, 32 layers     GENERATE_S=110
#   trl       bench_trl.py: DPO and GRPO steps                                   TRL_S=130
#   multi     torchrun over every GPU: bench_multi_gpu.py (a lane of its own;
#             MULTI_ARGS="--modes 1gpu,ddp,fsdp2,fsdp2-prefetch2,zero3" for every phase) MULTI_S=300
#   context   bench_context.py --only a (fasttune and HF, batch 1 QLoRA)        CONTEXT_S=300
#   reserve   bench_context.py --only a at RESERVE_LEN=131072 tokens under a GPU memory cap (RESERVE_CAP_GIB=30) between
#             the step's peak allocated and peak reserved memory: with the patch's expandable segments, then
#             with fixed segments (does the reserve, not the allocation, decide what fits?)  RESERVE_S=110 each
#   gemm      bench_gemm.py: one 8B layer's matrix products, and regroupings     GEMM_S=60
#   loss      bench_loss.py: the loss heads side by side (torch eager/compile, Liger, CCE, fasttune), W trainable,
#             frozen and an fp32 master W under bf16 hidden (--fp32-master)       LOSS_S=240
#   moe       bench_moe_step.py: 8 Qwen3-30B-A3B layers, MOE_STACKS (fasttune,unsloth) with the forward's CUDA
#             graphs, MOE_ROUNDS (3) alternating rounds in fresh processes (reserves move between processes) MOE_S=560
#   moemem    bench_moe_step.py --segments history: where the backward-graphed MoE step's reserve sits, each pool's
#             traced peak and what was alive then (fasttune only, 2 steps)           MOEMEM_S=120
#   vlm       bench_vlm.py: Qwen2.5-VL-7B shape with images, hf / fasttune / unsloth (VLM_ARGS) VLM_S=560
#   launch    accelerate launch examples/multi_gpu/train.py over every GPU with ddp.yaml,
#             fsdp2.yaml and deepspeed_zero3.yaml: the embedded model (full fine-tuning) and
#             a LoRA run of it saved to a folder (FastTrainer's on_train_begin setup), and a QLoRA run
#             (--load-in-4bit) with ddp.yaml and fsdp2.yaml                         LAUNCH_S=100 each
# Logs and JSON land in OUTDIR; at most 8 files come back from a device call, so tar OUTDIR into $OUT:
#   bash benchmarks/gpu_suite.sh /tmp/r step kernels,tests,trl,generate; tar czf $OUT/r.tgz -C /tmp r
set -u
out=${1:?usage: gpu_suite.sh OUTDIR LANE [LANE...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

job() {  # job NAME GPU
    local name=$1 gpu=$2
    local env="CUDA_VISIBLE_DEVICES=$gpu"
    case $name in
        step) env $env timeout "${STEP_S:-540}" python3 benchmarks/bench_step.py --budget-s $(( ${STEP_S:-540} - 20 )) \
                --stacks hf,liger,fasttune,fasttune-recompute,fasttune-auto,unsloth --steps 3 --warmup 1 \
                --out "$out/step.json" ${STEP_ARGS:-} ;;
        kernels) env $env timeout "${KERNELS_S:-90}" python3 benchmarks/bench_kernels.py --no-compile \
                --reps 15 --out "$out/kernels.json" ${KERNELS_ARGS---tune-rope} ;;
        tests) workers=$(python3 -c "import xdist, execnet" 2>/dev/null && echo "-n 3 --dist loadfile")  # 209 s instead of ~530 on an H100
                env $env timeout "${TESTS_S:-560}" python3 -m pytest -q -p no:cacheprovider -rfE --durations=25 --continue-on-collection-errors \
                $workers -m gpu tests
                env $env timeout 60 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/kernels/test_lora_glu.py \
                tests/kernels/test_lora.py tests/kernels/test_lora_wide.py tests/kernels/test_spare_columns.py \
                tests/kernels/test_rms_norm.py tests/model_patches/test_lora_widen.py \
                tests/model_patches/test_checkpointing.py tests/model_patches/test_residual.py ;;
        generate) env $env timeout "${GENERATE_S:-110}" bash -c "python3 benchmarks/bench_generate.py --new-tokens 64 --repeats 2 \
                --out $out/generate.json; python3 benchmarks/bench_generate.py --lora --new-tokens 64 --repeats 2 \
                --out $out/generate_lora.json" ;;
        trl) env $env timeout "${TRL_S:-130}" python3 benchmarks/bench_trl.py --budget-s $(( ${TRL_S:-130} - 40 )) \
                --out "$out/trl.json" ;;
        multi) timeout "${MULTI_S:-300}" torchrun --nproc_per_node "$(nvidia-smi -L | wc -l)" \
                benchmarks/bench_multi_gpu.py --budget-s $(( ${MULTI_S:-300} - 40 )) --out "$out/multi_gpu.json" \
                ${MULTI_ARGS:-} ;;
        context) env $env timeout "${CONTEXT_S:-300}" python3 benchmarks/bench_context.py --only a \
                --stacks fasttune,hf --deadline $(( ${CONTEXT_S:-300} - 20 )) --out "$out/context.json" ;;
        reserve) for conf in "" "expandable_segments:False"; do  # the product's switch, then fixed segments
                    echo "=== PYTORCH_CUDA_ALLOC_CONF=${conf:-unset} (cap ${RESERVE_CAP_GIB:-30} GiB)"
                    env $env ${conf:+PYTORCH_CUDA_ALLOC_CONF=$conf} timeout "${RESERVE_S:-110}" python3 \
                        benchmarks/bench_context.py --only a --stacks fasttune --start-len "${RESERVE_LEN:-131072}" --leg-cap 90 \
                        --deadline $(( ${RESERVE_S:-110} - 10 )) --gpu-cap-gib "${RESERVE_CAP_GIB:-30}" --segments \
                        --out "$out/reserve_${conf:-expandable}.json" | grep -E "tokens|stream|OOM|Error"
                done ;;
        fp8q) env $env timeout "${FP8Q_S:-570}" python3 benchmarks/fp8_quality.py --seeds "${FP8Q_SEEDS:-3}" \
                --budget-s $(( ${FP8Q_S:-570} - 40 )) \
                --variants "${FP8Q_VARIANTS:-fp8,fp8-fwd,fp8-bwd,fp8-w}" --out "$out/fp8_quality.json" ;;
        gemm) env $env timeout "${GEMM_S:-60}" python3 benchmarks/bench_gemm.py --out "$out/gemm.json" ;;
        loss) env $env timeout "${LOSS_S:-240}" python3 benchmarks/bench_loss.py --fp32-master --compile-budget 35 \
                --time-budget $(( ${LOSS_S:-240} - 90 )) --cell-seconds 0.5 --max-reps 5 --out "$out/loss.json" ;;
        moe) env $env timeout "${MOE_S:-560}" python3 benchmarks/bench_moe_step.py --budget-s $(( ${MOE_S:-560} - 20 )) \
                --layers 8 --steps 8 --warmup 3 --stacks "${MOE_STACKS:-fasttune,unsloth}" --forward-graphs \
                --rounds "${MOE_ROUNDS:-3}" --out "$out/moe.json" ${MOE_ARGS:-} ;;
        moemem) env $env timeout "${MOEMEM_S:-120}" python3 benchmarks/bench_moe_step.py --budget-s $(( ${MOEMEM_S:-120} - 10 )) \
                --layers 8 --steps 2 --warmup 3 --stacks fasttune --backward-graphs --segments history \
                --out "$out/moemem.json" ${MOEMEM_ARGS:-} ;;
        vlm) env $env timeout "${VLM_S:-560}" python3 benchmarks/bench_vlm.py --stack-timeout-s 240 \
                --steps 3 --warmup 1 --out "$out/vlm.json" ${VLM_ARGS:-} ;;
        launch) launch_examples ;;
        *) echo "unknown job $name" >&2; return 2 ;;
    esac
}

launch_examples() {  # every accelerate config of examples/multi_gpu, full fine-tuning and LoRA
    local n cfg model
    n=$(nvidia-smi -L | wc -l)
    python3 -c "from fasttune import embedded; t = embedded.build_tokenizer(); m = embedded.build_model(t); \
m.save_pretrained('/tmp/ft_embedded'); t.save_pretrained('/tmp/ft_embedded')" || return 1
    for cfg in ddp fsdp2 deepspeed_zero3; do
        for model in "" /tmp/ft_embedded "/tmp/ft_embedded --load-in-4bit"; do
            [ "$cfg" = deepspeed_zero3 ] && [ "${model#*--load-in-4bit}" != "$model" ] && continue  # QLoRA: DDP, FSDP2
            echo "=== $cfg ${model:-embedded (full)}"
            timeout "${LAUNCH_S:-100}" python3 -m accelerate.commands.launch --num_processes "$n" \
                --config_file "examples/multi_gpu/$cfg.yaml" examples/multi_gpu/train.py --steps 30 \
                --per-device-batch-size 8 --max-length 32 --output-dir "/tmp/ft_launch_$cfg" \
                ${model:+--model $model} 2>&1 | grep -E "fasttune:|process\(es\)|patched|fallback|Error|error" | head -40
            echo "=== rc=${PIPESTATUS[0]}"
        done
    done
}

lane() {  # lane GPU JOBS
    local gpu=$1 jobs=$2 name
    for name in ${jobs//,/ }; do
        echo "[$(date +%T)] gpu$gpu: $name"
        job "$name" "$gpu" > "$out/$name.log" 2>&1
        echo "[$(date +%T)] gpu$gpu: $name rc=$?"
    done
}

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
if [ "$#" -gt "$(nvidia-smi -L | wc -l)" ]; then  # a lane per GPU: jobs of one GPU go comma-separated in one lane
    echo "gpu_suite.sh: $# lanes for $(nvidia-smi -L | wc -l) GPU(s); join one GPU's jobs with commas (moemem,loss)" >&2
    exit 2
fi
gpu=0
for jobs in "$@"; do
    lane "$gpu" "$jobs" &
    gpu=$((gpu + 1))
done
wait
