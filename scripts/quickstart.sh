#!/usr/bin/env bash
# Fresh machine -> answer: install, write the bundled tiny checkpoint (deterministic, seed 0), then
# start a prefill worker, a decode worker and the OpenAI gateway on this machine and stream one chat
# completion through them with the openai client, printing the answer and the metrics it moved.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-models/tiny-flash}
[ -f "$MODEL/config.json" ] || .venv/bin/dsv4-make-tiny --preset flash --seed 0 --out "$MODEL"
.venv/bin/python scripts/pd_demo.py --model "$MODEL" --config configs/tiny-flash.yaml ${PROMPT:+--prompt "$PROMPT"}
