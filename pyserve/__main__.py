"""`pyserve COMMAND ...` (the console script) and `python -m pyserve COMMAND ...`, as `vllm`:

    serve [MODEL] [flags]   the OpenAI-compatible server; with no command, the flags are serve's
    chat | complete         talk to a running server
    bench serve ...         benchmarks/serve.py, the `vllm bench serve` client

Each command imports only what it needs: bench and the clients never import the server."""

import os
import sys

BENCHMARKS = ("serve", "latency", "throughput")
COMMANDS = ("serve", "chat", "complete", "bench")


def bench(argv: list[str], prog: str) -> int:
    """`pyserve bench NAME ...` runs benchmarks/NAME.py's main with the rest of argv. The
    benchmarks live beside the package in the source tree (they are not installed)."""
    from pathlib import Path

    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: {prog} bench {{{','.join(BENCHMARKS)}}} [flags]", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks").is_dir():
        print(f"{prog} bench needs pyserve's source tree; no benchmarks/ in {root}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module(f"benchmarks.{argv[0]}").main(argv[1:]) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "pyserve" if os.path.basename(sys.argv[0]) == "pyserve" else "python -m pyserve"
    if argv[:1] == ["--version"]:
        from pyserve import __version__

        print(f"pyserve {__version__}")
        return 0
    command = argv[0] if argv and argv[0] in COMMANDS else None
    if command == "bench":
        return bench(argv[1:], prog)
    if command in ("chat", "complete"):
        from pyserve.cli import client_main

        return client_main(command, argv[1:], prog=f"{prog} {command}")
    from pyserve.cli import main as serve

    if command == "serve":
        return serve(argv[1:], prog=f"{prog} serve")
    return serve(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
