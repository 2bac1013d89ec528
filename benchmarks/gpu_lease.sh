#!/usr/bin/env bash
# The engine's GPU checks for one lease of the device machine, in order of value; each writes
# its results under $OUT as soon as it ends, and none starts past the deadline.
#
# Here, before the lease (../shared/gpu/README.md):  bash ../shared/gpu/prepare.sh
# Then, with the device tool:  run(command="bash benchmarks/gpu_lease.sh", carry=[".whl", ".gpu"],
#                                  timeout_s=590)
#
#  1. the CUDA tests of the engine: the triton kernels compiled (LoRA shrink/expand, paged
#     decode, the fused Gumbel-max), a decode step that syncs only to read its tokens, a draw
#     replayed from a CUDA graph                              -> $OUT/cuda_tests.xml, .log
#  2. benchmarks/multiplex.py --device cuda on the Qwen2.5-0.5B shape (random weights, bf16):
#     K 1, 8, 16 at batch 64 and 256 (tokens/s, the steady decode step profiled: kernels and
#     device time per step, peak device memory), the matmul floor in a CUDA graph, training
#     rows (LoRA and full, 32 x 256 tokens), PEFT's mixed batch at 8 adapters, batch 64, 16 new
#     tokens; a JSON row after every row                      -> $OUT/multiplex_cuda.json
#  3. the same on the SmolLM2-1.7B shape, 16 adapters at batch 256 (decode only)
#                                                             -> $OUT/multiplex_cuda_1p7b.json
#  4. benchmarks/engine_overhead.py on the Qwen shape: ops, kernels and step time per decode
#     step with graphs on and off                             -> $OUT/engine_overhead_cuda.json
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-540}))
left() { echo $((DEADLINE - $(date +%s))); }
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$OUT/lease.log"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  >> "$OUT/lease.log" 2>&1
export PYTHONPATH=$PWD/.site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/lease.log" 2>&1

log "building random-weight models"
python3 - >> "$OUT/lease.log" 2>&1 <<'PY'
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

tok = AutoTokenizer.from_pretrained(".gpu/tok")
shapes = {
    "/tmp/qwen05b": (Qwen2ForCausalLM, Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                     num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                     rope_theta=1e6, max_position_embeddings=4096)),
    "/tmp/smol17b": (LlamaForCausalLM, LlamaConfig(vocab_size=49_152, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=True,
                     rope_theta=1.3e5, max_position_embeddings=4096)),
}
for folder, (cls, cfg) in shapes.items():
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    print("built", folder, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY

if [ "$(left)" -gt 120 ]; then
  log "1. CUDA tests"
  timeout $(( $(left) - 60 )) python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_triton_ops.py tests/test_sampling_ops.py tests/test_engine_ops.py \
    --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
  log "   rc=$?"
fi
if [ "$(left)" -gt 150 ]; then
  log "2. multiplex, Qwen2.5-0.5B shape"
  timeout $(( $(left) - 90 )) python3 benchmarks/multiplex.py --device cuda --model /tmp/qwen05b --threads 8 \
    --json "$OUT/multiplex_cuda.json" > "$OUT/multiplex_cuda.log" 2>&1
  log "   rc=$?"
fi
if [ "$(left)" -gt 90 ]; then
  log "3. multiplex, SmolLM2-1.7B shape"
  timeout $(( $(left) - 45 )) python3 benchmarks/multiplex.py --device cuda --model /tmp/smol17b --threads 8 \
    --ks 16 --batches 256 --phases decode --peft_row none --target_tps 16x256:40000 \
    --json "$OUT/multiplex_cuda_1p7b.json" > "$OUT/multiplex_cuda_1p7b.log" 2>&1
  log "   rc=$?"
fi
if [ "$(left)" -gt 60 ]; then
  log "4. engine_overhead, Qwen2.5-0.5B shape"
  timeout $(( $(left) - 15 )) python3 benchmarks/engine_overhead.py --device cuda --dtype bfloat16 \
    --models /tmp/qwen05b --batches 64,256 --adapters 1,16 --methods slots --prompt_tokens 128 --steps 8 --threads 8 \
    --json "$OUT/engine_overhead_cuda.json" > "$OUT/engine_overhead_cuda.log" 2>&1
  log "   rc=$?"
fi
log "done"
