"""Start-up time of each server, launch to the first 200 from its health route, as the median
of several cold starts: benchmarks.peers.run times one start per server, which on a shared
machine can be a second off either way.

    python -m benchmarks.peers.startup [--servers pyserve-q4,llamacpp-q4] [--repeats 5]

Each start is followed by a stop, so every start but the first finds the files in the page
cache, and none finds another server running. Prints each server's median, lowest and highest, and its median over the
first server's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.peers.run import DEFAULT_MODEL_DIR, _names
from benchmarks.peers.servers import RunningServer, ServerError, server_specs


def summarize(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "samples_s": samples}


def measure(spec, repeats: int, log_dir: Path, timeout_s: float) -> dict:
    samples = []
    for i in range(repeats):
        server = RunningServer(spec, log_dir / f"{spec.name}-{i}.log", timeout_s)
        samples.append(server.startup_s)
        server.stop()
    return summarize(samples)


def format_lines(results: dict[str, dict]) -> list[str]:
    first = next(iter(results.values()))["median_s"]
    return [f"{name:<18} median {r['median_s']:6.2f} s  (min {r['min_s']:.2f}, max {r['max_s']:.2f}, "
            f"{len(r['samples_s'])} starts)  {r['median_s'] / first:5.2f}x the first"
            for name, r in results.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.startup",
                                description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="pyserve-q4,llamacpp-q4", help="comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    specs = server_specs(args.model)
    results = {}
    with tempfile.TemporaryDirectory(prefix="pyserve-startup-") as logs:
        for name in _names(args.servers, list(specs), "--servers"):
            try:
                results[name] = measure(specs[name], args.repeats, Path(logs), args.startup_timeout)
            except ServerError as exc:
                print(f"[startup] {name}: {exc}", file=sys.stderr)
                return 1
            print(f"[startup] {name}: {results[name]['samples_s']}", flush=True)
    print("\n".join(format_lines(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
