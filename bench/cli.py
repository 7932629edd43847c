"""``dsv4-bench``: one entry point for the benchmarks.

    dsv4-bench serve  --base-url http://HOST:PORT ...   load the gateway (bench.serve_bench)
    dsv4-bench engine [--ckpt DIR] ...                   model step vs batch / context (bench.engine_bench)
    dsv4-bench gateway [--concurrency 1,64,512] ...      one gateway's text path, fake workers (bench.bench_gateway)
    dsv4-bench census --config YAML [--preset P] ...     what a decode step runs, op by op (bench.census)

Each subcommand prints a side-by-side table and writes JSON (``--help`` of each lists its flags).
"""
from __future__ import annotations

import sys

COMMANDS = {"serve": "bench.serve_bench", "engine": "bench.engine_bench", "gateway": "bench.bench_gateway",
            "census": "bench.census"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"dsv4-bench: error: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})",
                  file=sys.stderr)
            return 2
        return 0 if argv else 2
    import importlib
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
