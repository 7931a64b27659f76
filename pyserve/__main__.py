import sys

BENCHMARKS = ("serve", "latency", "throughput")


def bench(argv: list[str]) -> int:
    """`python -m pyserve bench NAME ...` runs benchmarks/NAME.py's main with the rest of argv.
    The benchmarks live beside the package in the source tree (they are not installed), and
    the server is never imported for them."""
    from pathlib import Path

    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m pyserve bench {{{','.join(BENCHMARKS)}}} [flags]", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks").is_dir():
        print(f"python -m pyserve bench needs pyserve's source tree; no benchmarks/ in {root}",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module(f"benchmarks.{argv[0]}").main(argv[1:]) or 0


if sys.argv[1:2] == ["bench"]:
    sys.exit(bench(sys.argv[2:]))
else:
    from pyserve.cli import main

    sys.exit(main())
