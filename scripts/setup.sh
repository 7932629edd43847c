#!/usr/bin/env bash
# Create .venv and install dsv4-pd with its test extras. torch==2.13.0 first: an unpinned torch
# would pull a multi-GB CUDA build; with the pin installed, the project's range installs nothing more.
# The CPU wheel comes from pip's configured sources (this workplace keeps it on disk); elsewhere set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
.venv/bin/python -m pip install -q -e ".[dev]"
