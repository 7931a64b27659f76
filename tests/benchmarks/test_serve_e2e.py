"""`python -m benchmarks.serve` end to end: its main, in this process, against the real
`python -m pyserve` on the tiny random model, through both endpoints."""

import json
import subprocess
import sys

import pytest

from benchmarks.serve import main
from tests.e2e.server import ServerProcess

BLOCK_LINES = ("============ Serving Benchmark Result ============", "Successful requests:",
               "Failed requests:", "Maximum request concurrency:", "Benchmark duration (s):",
               "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
               "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
               "Peak concurrent requests:", "Total token throughput (tok/s):",
               "---------------Time to First Token----------------", "Mean TTFT (ms):",
               "Median TTFT (ms):", "P99 TTFT (ms):",
               "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):",
               "---------------Inter-token Latency----------------", "P99 ITL (ms):")


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess("--model", str(tiny_dir), "--disable-log-requests")
    yield srv
    assert srv.stop() == 0


def _value(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(label))[40:].strip()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_benchmark_against_pyserve(server, tiny_dir, tmp_path, capsys, endpoint):
    rc = main(["--base-url", server.url, "--endpoint", endpoint, "--model", str(tiny_dir),
               "--dataset-name", "random", "--random-input-len", "16",
               "--random-output-len", "8", "--num-prompts", "8", "--ignore-eos",
               "--max-concurrency", "4", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "result.json"])
    out = capsys.readouterr().out
    assert rc == 0
    for label in BLOCK_LINES:
        assert label in out, label
    assert _value(out, "Successful requests:") == "8"
    assert _value(out, "Failed requests:") == "0"
    assert _value(out, "Total generated tokens:") == "64"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["backend"] == ("openai-chat" if "chat" in endpoint else "openai")
    assert (result["completed"], result["failed"], result["num_prompts"]) == (8, 0, 8)
    assert result["total_output_tokens"] == 64 and result["output_lens"] == [8] * 8
    assert result["max_concurrency"] == 4 and result["request_rate"] == "inf"
    assert result["errors"] == [""] * 8
    assert len(result["ttfts"]) == 8 and all(t > 0 for t in result["ttfts"])
    # 8 tokens: 7 gaps each (chat adds one for the role chunk before the first token)
    assert [len(i) for i in result["itls"]] == [8 if "chat" in endpoint else 7] * 8
    assert result["total_input_tokens"] == sum(result["input_lens"])
    if "chat" not in endpoint:  # the server counted the prompt as the dataset did
        assert result["input_lens"] == [16] * 8
    for key in ("date", "model_id", "burstiness", "request_throughput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms"):
        assert key in result, key
    assert result["output_throughput"] == pytest.approx(64 / result["duration"])


def test_pyserve_bench_dispatch_skips_the_server():
    code = ("import runpy, sys\n"
            "sys.argv = ['pyserve', 'bench', 'serve', '--help']\n"
            "try:\n"
            "    runpy.run_module('pyserve', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    assert exc.code == 0, exc.code\n"
            "assert 'pyserve.server.app' not in sys.modules and 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--max-concurrency" in done.stdout and "--dataset-name" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "pyserve", "bench", "nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "serve,latency,throughput" in bad.stderr
