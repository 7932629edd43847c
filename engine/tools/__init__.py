"""Command-line tools on one worker's engine: ``dsv4-generate`` (greedy generation from a
checkpoint), ``dsv4-offline`` (a JSONL dataset through the engine) and the dataset reader it
uses (``dataset``). The benchmarks' entry point is the top-level ``bench`` package."""
