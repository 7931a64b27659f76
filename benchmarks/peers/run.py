"""pyserve beside its peers (vLLM for CPU, llama.cpp's llama-server) on this machine, in one
command: each server in turn is started on loopback with the same model, timed to healthy,
warmed with one short request, driven through the same workloads by our client
(benchmarks.serve, in this process) and stopped; then a table, results.json and chart.png.

    python -m benchmarks.peers.run [--servers pyserve,vllm,llamacpp-q4,llamacpp-f32]
        [--workloads W1,W2,W3,W4] [--repeats 3] [--num-prompts-scale 1.0] [--out DIR]
        [--interleave]

Install the peers first (benchmarks/peers/README.md). Each (server, workload) runs --repeats
times with the workload's seeds (fresh prompts each time, so no cache carries over from one
repeat or workload to the next); the table shows the medians over repeats of output tokens/s, median TTFT and
median TPOT, with each server's ratio to pyserve on the same workload, its start-up time and
the peak RSS of its process tree. The machine's ceilings (benchmarks/ceilings.py) are measured
first, before any server runs, and the "roof" column puts each row against them: W1 (one
stream) the fraction of the bandwidth roofline its TPOT reaches (the bytes of the server's
weights a decode step reads / the measured read bandwidth, over the median TPOT), the other
workloads their prompt + output tokens/s as a fraction of the float32 GEMM ceiling. Needs a
quiet machine: anything else running skews every row. --interleave starts every server first
and runs each workload's repeats taking turns between them, for machines whose speed drifts
by more than the differences being measured.
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
    p.add_argument("--interleave", action="store_true",
                   help="start every server first (all stay up: their memory together must fit), "
                   "then run each workload's repeats taking turns: repeat 1 on each server, then "
                   "repeat 2, ... (each run alone, the others idle), so that a drift of the "
                   "machine's speed lands on all alike; each server's memory is sampled over its "
                   "start-up and its own runs")
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


class ServerBench:
    """One server's part of a run: started and warmed, its measured runs, stopped; its entry
    in results."""

    def __init__(self, spec, args):
        self.spec, self.args = spec, args
        self.entry = {"what": spec.what, "startup_s": None, "peak_rss_gib": None,
                      "peak_pss_gib": None, "error": None, "workloads": {}}
        self.server = None
        self.log = None
        self.runs: dict[str, list[dict]] = {}

    def start(self) -> bool:
        """Start, time to healthy, warm with one short request; False (the error noted) if not."""
        spec, args = self.spec, self.args
        print(f"[peers] {spec.name}: starting ({spec.what})", flush=True)
        try:
            self.server = RunningServer(spec, args.out / "logs" / f"{spec.name}.log", args.startup_timeout)
        except ServerError as exc:
            return self._failed(exc)
        self.entry["startup_s"] = self.server.startup_s
        print(f"[peers] {spec.name}: healthy after {self.server.startup_s:.1f} s on "
              f"{self.server.base_url}", flush=True)
        self.log = open(args.out / "logs" / f"client-{spec.name}.log", "w", encoding="utf-8")
        try:
            # one short request first, so that no lazy first-use cost lands in W1's first run
            run_client(self.server, ["--tokenizer", str(args.model), "--num-prompts", "1",
                                     "--random-input-len", "32", "--random-output-len", "8"], self.log)
        except (ServerError, OSError, SystemExit) as exc:  # SystemExit: serve's errors
            return self._failed(exc)
        finally:
            self.server.memory.pause()  # sampled again during its measured runs only
        return True

    def run(self, w: Workload, repeat: int) -> bool:
        """One measured run of w; False (the error noted) if it failed."""
        start = time.perf_counter()
        self.server.memory.resume()
        try:
            r = run_workload(self.server, w, self.args, w.seed(repeat), self.log)
        except (ServerError, OSError, KeyError, SystemExit) as exc:
            return self._failed(exc)
        finally:  # idle until its next run; PSS read here, where it slows nothing measured
            self.server.memory.pause()
        runs = self.runs.setdefault(w.name, [])
        runs.append(r)
        if len(runs) == self.args.repeats:  # a workload is reported with all its repeats only
            self.entry["workloads"][w.name] = summarize(runs)
        print(f"[peers] {self.spec.name} {w.name} #{repeat + 1}: "
              f"{r['output_throughput']:.1f} tok/s, TTFT {r['median_ttft_ms']:.0f} ms, "
              f"TPOT {r['median_tpot_ms']:.1f} ms, {r['failed']} failed, "
              f"{r['short_outputs']} short ({time.perf_counter() - start:.0f} s)", flush=True)
        return True

    @property
    def ok(self) -> bool:
        return self.server is not None and self.entry["error"] is None

    def _failed(self, exc: BaseException) -> bool:
        print(f"[peers] {self.spec.name}: {exc}", file=sys.stderr)
        self.entry["error"] = str(exc)
        return False

    def stop(self) -> dict:
        if self.log is not None:
            self.log.close()
        if self.server is not None:
            self.server.stop()
            self.entry["peak_rss_gib"] = self.server.memory.peak_rss / GIB
            self.entry["peak_pss_gib"] = self.server.memory.peak_pss / GIB
        return self.entry


def bench_server(spec, workloads: list[Workload], args) -> dict:
    """Start, warm, run every workload --repeats times, stop: the server's entry in results."""
    bench = ServerBench(spec, args)
    try:
        if bench.start():
            for w in workloads:
                if not all(bench.run(w, repeat) for repeat in range(args.repeats)):
                    break
    finally:
        bench.stop()
    return bench.entry


def bench_interleaved(chosen: dict, args) -> dict:
    """--interleave: every server started and warmed first, then each workload's repeats
    taking turns (repeat 1 on each server, then repeat 2, ...), then all stopped. A drift of
    the machine's speed over the minutes of a run then lands on every server alike, where one
    server after another would carry it into their ratios."""
    benches = {name: ServerBench(spec, args) for name, (spec, _) in chosen.items()}
    try:
        for bench in benches.values():
            bench.start()
        for w in {w.name: w for _, ws in chosen.values() for w in ws}.values():
            for repeat in range(args.repeats):
                for name, bench in benches.items():
                    if bench.ok and w in chosen[name][1]:
                        bench.run(w, repeat)
    finally:
        entries = {name: bench.stop() for name, bench in benches.items()}
    return entries


def _cell(m: dict, base: dict, key: str, fmt: str, width: int) -> str:
    """A median and its ratio to pyserve's on the same workload."""
    ratio = f"{m[key] / base[key]:.2f}x" if base.get(key) else "-"
    return f"{format(m[key], fmt):>{width}} {ratio:>6}"


def format_table(results: dict) -> str:
    """Every workload x server: medians, ratios to a pyserve row, start-up and peak memory."""
    head = (f"{'workload':<8} {'server':<17} {'out tok/s':>9} {'x':>6} {'TTFT ms':>9} {'x':>6} "
            f"{'TPOT ms':>8} {'x':>6} {'roof':>5} {'start s':>7} {'RSS GiB':>7}  note")
    lines = [head, "-" * len(head)]
    servers = results["servers"]
    # the ratios' base, per workload: the pyserve row, else the first pyserve row that has the
    # workload (pyserve-q4 in a run of the GGUF rows), so that a run without the float32 row,
    # or with a failed one, still prints its ratios
    names = [BASELINE] + [n for n in servers if n.startswith("pyserve") and n != BASELINE]
    bases = []
    for w in results["workloads"]:
        baseline = next((n for n in names
                         if "median" in servers.get(n, {}).get("workloads", {}).get(w, {})), None)
        if baseline is not None:
            bases.append(baseline)
        base = servers[baseline]["workloads"][w]["median"] if baseline else {}
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
    ratios = (f"x = the server's figure / {' or '.join(dict.fromkeys(bases))}'s on the same "
              "workload (tok/s: higher is better; TTFT, TPOT: lower is better)" if bases
              else "x: no pyserve row, so no ratios")
    lines.append(f"medians of {results['repeats']} run(s); {ratios}; roof: W1 the bandwidth "
                 "roofline's TPOT / the median TPOT, the others prompt + output tok/s / the GEMM "
                 "ceiling's")
    return "\n".join(lines)


def roofline(c: dict, spec) -> dict:
    """The server's own bandwidth roofline: the bytes of its weights a decode step reads (its
    GGUF's tensors, of a mixture of experts the active experts only; or the model's
    safetensors) over the measured read bandwidth."""
    if spec.weights is not None and spec.weights.exists():
        from pyserve.model.gguf import decode_read_bytes

        gb = decode_read_bytes(spec.weights)[0] / 1e9 * spec.weight_scale
    else:
        gb = c["weight_gb_per_decode_token"] * spec.weight_scale
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
        results["machine"]["ceilings"] = ceilings.measure(args.gguf or args.model)
        print(ceilings.describe(results["machine"]["ceilings"]), flush=True)
    chosen = {}
    for name in servers:
        spec = specs[name]
        picked = [w for w in workloads if spec.workloads is None or w.name in spec.workloads]
        if picked:
            chosen[name] = (spec, picked)
    if args.interleave:
        results["interleaved"] = True
        results["servers"] = bench_interleaved(chosen, args)
    else:
        results["servers"] = {name: bench_server(spec, picked, args)
                              for name, (spec, picked) in chosen.items()}
    if "ceilings" in results["machine"]:
        for name, (spec, _) in chosen.items():
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
