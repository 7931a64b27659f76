"""benchmarks.peers.run --interleave: every server up first, then each workload's repeats
taking turns between them, each server's entry as a plain run would give it. Two real pyserve
servers on the tiny model, W1 cut to one prompt."""

from __future__ import annotations

import argparse
import sys

from benchmarks.peers.run import bench_interleaved
from benchmarks.peers.servers import ServerSpec
from benchmarks.peers.workloads import WORKLOADS


def _pyserve(name: str, model, *flags: str) -> ServerSpec:
    return ServerSpec(name, f"pyserve {' '.join(flags)}".strip(), lambda port: [
        sys.executable, "-m", "pyserve", "--model", str(model), "--port", str(port),
        "--kv-cache-memory", "64MiB", *flags])


def test_interleaved_runs_take_turns(tiny_dir, tmp_path, capsys):
    args = argparse.Namespace(model=tiny_dir, out=tmp_path, repeats=2, num_prompts_scale=0.125,
                              startup_timeout=300.0)
    w1 = WORKLOADS["W1"]
    chosen = {"a": (_pyserve("a", tiny_dir), [w1]),
              "b": (_pyserve("b", tiny_dir, "--no-async-scheduling"), [w1]),
              "broken": (ServerSpec("broken", "never starts", lambda port: ["false"]), [w1])}
    entries = bench_interleaved(chosen, args)
    order = [line.split()[1] + line.split()[3].rstrip(":") for line in capsys.readouterr().out.splitlines()
             if line.startswith("[peers] ") and " W1 #" in line]
    assert order == ["a#1", "b#1", "a#2", "b#2"]
    for name in ("a", "b"):
        entry = entries[name]
        assert entry["error"] is None and entry["startup_s"] > 0 and entry["peak_rss_gib"] > 0
        assert entry["peak_pss_gib"] > 0  # read at the pauses between runs
        w = entry["workloads"]["W1"]
        assert len(w["runs"]) == 2 and w["full_length"]
        assert w["median"]["total_output_tokens"] == w1.output_len
    assert "exited" in entries["broken"]["error"] and entries["broken"]["workloads"] == {}
