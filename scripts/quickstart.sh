#!/usr/bin/env bash
# Fresh machine -> answer: install, write the bundled tiny checkpoint (deterministic, seed 0),
# generate from it with the real DeepSeek-V4 tokenizer, then run the bundled InfiniteBench-shaped
# sample through the continuous-batching engine (chat template, chunked prefill, paged state).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-models/tiny-flash}
[ -f "$MODEL/config.json" ] || .venv/bin/dsv4-make-tiny --preset flash --seed 0 --out "$MODEL"
.venv/bin/dsv4-generate --model "$MODEL" --prompt "${PROMPT:-The capital of France is}" --max-new-tokens 16 --json
mkdir -p out
.venv/bin/dsv4-offline --config configs/tiny-flash.yaml --model "$MODEL" --out out/offline.jsonl --no-progress
echo "per-sample results: out/offline.jsonl"
