"""`python -m benchmarks.soak --minutes 2` on the tiny model: two minutes of mixed traffic
(streaming and not, chat, n=2, logprobs, a prefix-sharing slice, 10% disconnects, 1% invalid
requests) after which the books balance, every request got an answer its kind allows, and
descriptors and threads did not pile up. The memory slope is reported, not judged: two
minutes are too short to tell a leak from an allocator settling (the 10-minute run is)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_soak_two_minutes(tiny_dir):
    done = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--minutes", "2", "--json",
                           "--model", str(tiny_dir), "--interval", "5", "--checkpoint", "15"],
                          capture_output=True, text=True, timeout=600)
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print({k: v for k, v in report.items() if k not in ("samples", "books")})
    assert done.returncode == 0, (report.get("books_problem"), report["unexpected"])
    assert report["books_balanced"] and report["unexpected"] == {}
    outcomes = report["outcomes"]
    assert outcomes["ok"] > 100 and outcomes.get("disconnected", 0) > 5
    books = report["books"]
    assert books["requests_aborted"] >= outcomes["disconnected"]  # every disconnect aborted
    assert len(report["samples"]) >= 10
    assert report["fds"]["last"] <= report["fds"]["first"] + 20  # connections do not leak
    assert report["threads"]["max"] <= report["threads"]["first"] + 8
    assert report["rss_anon_slope_kib_per_1000_requests"] is not None
    # quiescent checkpoints: the traffic paused, the server idle and trimmed, RssAnon read
    checkpoints = report["checkpoints"]
    assert len(checkpoints) >= 2
    assert all(c["rss_anon_kib"] > 0 for c in checkpoints)
    assert checkpoints[1]["requests"] > checkpoints[0]["requests"] > 0
    # the KV pool's resident share is read at each checkpoint, and is what its touched blocks hold
    books_block = books["kv_bytes_per_block"]
    for c in checkpoints:
        assert c["kv_blocks_touched"] > 0
        assert c["kv_pool_resident_kib"] is not None
        assert c["kv_pool_resident_kib"] <= c["kv_blocks_touched"] * books_block // 1024 + 64
    assert report["quiescent_slope_excluding_kv_pool_kib_per_1000_requests"] is not None

