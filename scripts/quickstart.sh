#!/usr/bin/env bash
# Fresh machine -> answer: install, write the bundled tiny checkpoint (deterministic, seed 0),
# and generate from it with the real DeepSeek-V4 tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-models/tiny-flash}
[ -f "$MODEL/config.json" ] || .venv/bin/dsv4-make-tiny --preset flash --seed 0 --out "$MODEL"
.venv/bin/dsv4-generate --model "$MODEL" --prompt "${PROMPT:-The capital of France is}" --max-new-tokens 16 --json
