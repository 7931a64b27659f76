"""pyserve beside its peers (vLLM for CPU, llama.cpp's llama-server) on this machine, in one
command: each server in turn is started on loopback with the same model, timed to healthy,
warmed with one short request, driven through the same workloads by our client
(benchmarks.serve, in this process) and stopped; then a table, results.json and chart.png.

    python -m benchmarks.peers.run [--servers pyserve,vllm,llamacpp-q4,llamacpp-f32]
        [--workloads W1,W2,W3,W4] [--repeats 3] [--num-prompts-scale 1.0] [--out DIR]

Install the peers first (benchmarks/peers/README.md). Each (server, workload) runs --repeats
times with the workload's seeds (fresh prompts each time, so no cache carries over from one
repeat or workload to the next); the table shows the medians over repeats of output tokens/s, median TTFT and
median TPOT, with each server's ratio to pyserve on the same workload, its start-up time and
the peak RSS of its process tree. The machine's ceilings (benchmarks/ceilings.py) are measured
first, before any server runs, and the "roof" column puts each row against them: W1 (one
stream) the fraction of the bandwidth roofline its TPOT reaches (the bytes of the server's
weights a decode step reads / the measured read bandwidth, over the median TPOT), the other
workloads their prompt + output tokens/s as a fraction of the float32 GEMM ceiling. Needs a
quiet machine: anything else running skews every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from benchmarks import ceilings, serve
from benchmarks.peers.servers import (DEFAULT_LLAMA_THREADS, PEERS_DIR, REPO, RunningServer,
                                       ServerError, server_specs)
from benchmarks.peers.workloads import WORKLOADS, Workload

DEFAULT_MODEL_DIR = Path.home() / ".cache/pyserve/models/SmolLM2-135M-Instruct"
DEFAULT_SERVERS = ("pyserve,pyserve-bf16,pyserve-q4,pyserve-q4-int8,pyserve-noprefix,vllm,llamacpp-q4,"
                   "llamacpp-f32")
BASELINE = "pyserve"
# the scalars kept per run; the medians over repeats are taken of each
KEPT = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")
GIB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.run",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=DEFAULT_SERVERS,
                   help=f"comma-separated, in run order (default {DEFAULT_SERVERS})")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of W1..W4")
    p.add_argument("--repeats", type=int, default=3, help="runs per (server, workload); medians")
    p.add_argument("--num-prompts-scale", type=float, default=1.0,
                   help="multiplies each workload's prompt count (at least 1); 0.25: a smoke run")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                   help="model directory every server loads (llama-server: the GGUFs made from it)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="also offer pyserve-gguf, pyserve-gguf-int8, pyserve-gguf-bf16 and llamacpp-gguf on this file (its conversion "
                        "replaces --model), e.g. Gemma 3: python tools/fetch_gemma3_gguf.py")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/peers/results",
                   help="folder for results.json, chart.png and logs/")
    p.add_argument("--llama-threads", type=int, default=DEFAULT_LLAMA_THREADS,
                   help="llama-server -t (default 2, all cores; 1 leaves a core for the rest)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to healthy")
    p.add_argument("--no-ceilings", action="store_true", help="skip measuring GEMM and bandwidth")
    return p


def _names(text: str, known, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")
    return names


def run_client(server: RunningServer, argv: list[str], log) -> None:
    """benchmarks.serve against the server, its printout into log."""
    with contextlib.redirect_stdout(log):
        code = serve.main(["--base-url", server.base_url, *argv])
    log.flush()
    if code != 0:
        raise ServerError(f"the client completed no request against {server.spec.name}")


def run_workload(server: RunningServer, workload: Workload, args, seed: int, log) -> dict:
    """One measured run: vLLM's result keys (the scalars in KEPT) and the output lengths."""
    name = f"{server.spec.name}-{workload.name}-seed{seed}.json"
    run_client(server, ["--tokenizer", str(args.model), "--seed", str(seed),
                        *workload.serve_args(args.num_prompts_scale), "--save-result",
                        "--result-dir", str(args.out / "runs"), "--result-filename", name], log)
    with open(args.out / "runs" / name, encoding="utf-8") as f:
        result = json.load(f)
    kept = {k: result[k] for k in KEPT}
    kept["short_outputs"] = sum(n != workload.output_len for n in result["output_lens"])
    return kept


def summarize(runs: list[dict]) -> dict:
    median = {k: statistics.median(r[k] for r in runs) for k in KEPT}
    return {"median": median, "runs": runs,
            "full_length": all(r["short_outputs"] == 0 and r["failed"] == 0 for r in runs)}


def bench_server(spec, workloads: list[Workload], args) -> dict:
    """Start, warm, run every workload --repeats times, stop: the server's entry in results."""
    entry = {"what": spec.what, "startup_s": None, "peak_rss_gib": None, "peak_pss_gib": None,
             "error": None, "workloads": {}}
    print(f"[peers] {spec.name}: starting ({spec.what})", flush=True)
    log_path = args.out / "logs" / f"client-{spec.name}.log"
    try:
        server = RunningServer(spec, args.out / "logs" / f"{spec.name}.log", args.startup_timeout)
    except ServerError as exc:
        print(f"[peers] {spec.name}: {exc}", file=sys.stderr)
        entry["error"] = str(exc)
        return entry
    entry["startup_s"] = server.startup_s
    print(f"[peers] {spec.name}: healthy after {server.startup_s:.1f} s on {server.base_url}",
          flush=True)
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            # one short request first, so that no lazy first-use cost lands in W1's first run
            run_client(server, ["--tokenizer", str(args.model), "--num-prompts", "1",
                                "--random-input-len", "32", "--random-output-len", "8"], log)
            for w in workloads:
                runs = []
                for repeat in range(args.repeats):
                    start = time.perf_counter()
                    runs.append(run_workload(server, w, args, w.seed(repeat), log))
                    r = runs[-1]
                    print(f"[peers] {spec.name} {w.name} #{repeat + 1}: "
                          f"{r['output_throughput']:.1f} tok/s, TTFT {r['median_ttft_ms']:.0f} ms, "
                          f"TPOT {r['median_tpot_ms']:.1f} ms, {r['failed']} failed, "
                          f"{r['short_outputs']} short ({time.perf_counter() - start:.0f} s)",
                          flush=True)
                entry["workloads"][w.name] = summarize(runs)
    except (ServerError, OSError, KeyError, SystemExit) as exc:  # SystemExit: serve's errors
        print(f"[peers] {spec.name}: {exc}", file=sys.stderr)
        entry["error"] = str(exc)
    finally:
        server.stop()
        entry["peak_rss_gib"] = server.memory.peak_rss / GIB
        entry["peak_pss_gib"] = server.memory.peak_pss / GIB
    return entry


def _cell(m: dict, base: dict, key: str, fmt: str, width: int) -> str:
    """A median and its ratio to pyserve's on the same workload."""
    ratio = f"{m[key] / base[key]:.2f}x" if base.get(key) else "-"
    return f"{format(m[key], fmt):>{width}} {ratio:>6}"


def format_table(results: dict) -> str:
    """Every workload x server: medians, ratios to pyserve, start-up and peak memory."""
    head = (f"{'workload':<8} {'server':<17} {'out tok/s':>9} {'x':>6} {'TTFT ms':>9} {'x':>6} "
            f"{'TPOT ms':>8} {'x':>6} {'roof':>5} {'start s':>7} {'RSS GiB':>7}  note")
    lines = [head, "-" * len(head)]
    servers = results["servers"]
    for w in results["workloads"]:
        base = servers.get(BASELINE, {}).get("workloads", {}).get(w, {}).get("median", {})
        for name, s in servers.items():
            row = s["workloads"].get(w)
            if row is None:
                if s["error"]:
                    lines.append(f"{w:<8} {name:<17} {'failed: ' + s['error'].splitlines()[0]}")
                continue
            m = row["median"]
            note = "" if row["full_length"] else "short outputs or failures"
            start = f"{s['startup_s']:.1f}" if s["startup_s"] is not None else "-"
            rss = f"{s['peak_rss_gib']:.2f}" if s["peak_rss_gib"] is not None else "-"
            lines.append(f"{w:<8} {name:<17} {_cell(m, base, 'output_throughput', '.1f', 9)} "
                         f"{_cell(m, base, 'median_ttft_ms', '.0f', 9)} "
                         f"{_cell(m, base, 'median_tpot_ms', '.1f', 8)} "
                         f"{_roof(results, s, w, m):>5} {start:>7} {rss:>7}  {note}")
    lines.append(f"medians of {results['repeats']} run(s); x = the server's figure / pyserve's "
                 "on the same workload (tok/s: higher is better; TTFT, TPOT: lower is better); "
                 "roof: W1 the bandwidth roofline's TPOT / the median TPOT, the others prompt + "
                 "output tok/s / the GEMM ceiling's")
    return "\n".join(lines)


def roofline(c: dict, spec) -> dict:
    """The server's own bandwidth roofline: the bytes of its weights a decode step reads (its
    GGUF's size, or the model's safetensors) over the measured read bandwidth."""
    gb = (spec.weights.stat().st_size / 1e9 if spec.weights is not None and spec.weights.exists()
          else c["weight_gb_per_decode_token"]) * spec.weight_scale
    return {"weight_gb_per_decode_token": gb, "min_ms_per_token_single_stream": gb / c["read_bandwidth_gbs"] * 1000}


def _roof(results: dict, server: dict, workload: str, m: dict) -> str:
    c, own = results["machine"].get("ceilings"), server.get("roofline")
    if c is None or own is None:
        return "-"
    if workload == "W1":
        return f"{own['min_ms_per_token_single_stream'] / m['median_tpot_ms']:.0%}" if m["median_tpot_ms"] else "-"
    return f"{m['total_token_throughput'] / c['max_tokens_per_s_compute']:.0%}"


def draw_chart(results_path: Path, chart_path: Path) -> None:
    """chart.py here if matplotlib imports, else in the peers' tooling venv, which has it."""
    try:
        import matplotlib  # noqa: F401  (only to learn whether it is here)
    except ImportError:
        tools_python = PEERS_DIR / "tools/bin/python"
        if not tools_python.exists():
            print("[peers] no chart: matplotlib is not installed here; run "
                  "bash benchmarks/peers/install_tools.sh, then "
                  f"{tools_python} -m benchmarks.peers.chart {results_path} {chart_path}",
                  file=sys.stderr)
            return
        subprocess.run([str(tools_python), "-m", "benchmarks.peers.chart", str(results_path),
                        str(chart_path)], cwd=REPO, check=True)
        return
    from benchmarks.peers.chart import draw
    with open(results_path, encoding="utf-8") as f:
        draw(json.load(f), chart_path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gguf is not None:  # the client's tokenizer and the ceilings read its conversion
        from pyserve.config import ModelConfig
        from pyserve.model.source import resolve_model

        args.gguf = args.gguf.resolve()
        args.model = resolve_model(ModelConfig(model=str(args.gguf))).path
    specs = server_specs(args.model, args.llama_threads, args.gguf)
    servers = _names(args.servers, list(specs), "--servers")
    workloads = [WORKLOADS[n] for n in _names(args.workloads, list(WORKLOADS), "--workloads")]
    if not 1 <= args.repeats <= 1000 or args.num_prompts_scale <= 0:  # 1000: seeds per workload
        raise SystemExit("--repeats must be 1 to 1000 and --num-prompts-scale above 0")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"date": datetime.now().isoformat(timespec="seconds"), "model": str(args.model),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "repeats": args.repeats, "num_prompts_scale": args.num_prompts_scale,
               "llama_threads": args.llama_threads,
               "workloads": {w.name: {"what": w.what, "output_len": w.output_len,
                                      "num_prompts": w.prompts(args.num_prompts_scale)}
                             for w in workloads},
               "servers": {}}
    if not args.no_ceilings:
        results["machine"]["ceilings"] = ceilings.measure(args.model)
        print(ceilings.describe(results["machine"]["ceilings"]), flush=True)
    for name in servers:
        spec = specs[name]
        chosen = [w for w in workloads if spec.workloads is None or w.name in spec.workloads]
        if chosen:
            results["servers"][name] = bench_server(spec, chosen, args)
            if "ceilings" in results["machine"]:
                results["servers"][name]["roofline"] = roofline(results["machine"]["ceilings"], spec)
    results_path = args.out / "results.json"
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(format_table(results))
    draw_chart(results_path, args.out / "chart.png")
    print(f"[peers] wrote {results_path} and {args.out / 'chart.png'}")
    return 0 if all(s["error"] is None for s in results["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
