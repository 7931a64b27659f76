"""`python -m benchmarks.stress --quick` end to end on the tiny model (under a minute): every
phase runs against real servers and reports figures that hold whatever the machine's load;
timing bounds are only against blow-ups."""

import json
import subprocess
import sys


def test_stress_quick(tiny_dir):
    done = subprocess.run([sys.executable, "-m", "benchmarks.stress", "--quick", "--json",
                           "--model", str(tiny_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    faults = report["faults"]
    assert faults["streams_with_error_event"] >= 1 and faults["errored_in_books"] >= 1
    assert faults["streams_with_error_event"] + faults["streams_completed"] == 4
    assert faults["health_after"] == 200 and faults["next_request"] == 200  # recovered
    streams = report["streams"]
    assert streams["completed"] == 150 and streams["peak_streams_held_client"] == 150
    assert streams["health"]["failures"] == 0 and streams["health"]["p99_ms"] < 1000
    half_open = report["half-open"]
    assert half_open["closed_by_server_at_header_timeout"] == 100
    assert half_open["normal_requests"]["count"] >= 1
    assert report["disconnects"]["disconnects"] == 8 and report["disconnects"]["p99_ms"] < 5000
    overload = report["overload"]
    assert overload["429"] > 0 and overload["429_with_retry_after"] == overload["429"]
    assert overload["ok"] + overload["429"] == 24
    shutdown = report["shutdown"]
    assert shutdown["exit_code"] == 0 and shutdown["streams_failed"] == 0
    assert shutdown["streams_ended_s"] < shutdown["grace_s"] + 1.0
    assert report["books_main"]["requests_errored"] == faults["errored_in_books"]
    assert report["books_main"]["requests_aborted"] >= 8  # at least the disconnects
