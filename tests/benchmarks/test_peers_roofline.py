"""The peers table's "roof" column: W1 against the server's own bandwidth roofline (the bytes
its weights file holds), the batched workloads against the GEMM ceiling."""

from __future__ import annotations

from benchmarks.peers.run import format_table, roofline
from benchmarks.peers.servers import ServerSpec


def _median(tpot_ms: float, total_tok_s: float) -> dict:
    return {"output_throughput": 50.0, "median_ttft_ms": 300.0, "median_tpot_ms": tpot_ms,
            "total_token_throughput": total_tok_s}


def test_roof_column_uses_each_servers_own_weights(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 100_000)  # 1e-4 GB
    ceilings = {"read_bandwidth_gbs": 10.0, "weight_gb_per_decode_token": 0.5,
                "max_tokens_per_s_compute": 400.0}
    quantized = roofline(ceilings, ServerSpec("q", "", lambda port: [], weights=gguf))
    assert abs(quantized["min_ms_per_token_single_stream"] - 0.01) < 1e-12  # 1e-4 GB at 10 GB/s
    halved = roofline(ceilings, ServerSpec("b", "", lambda port: [], weight_scale=0.5))
    assert abs(halved["min_ms_per_token_single_stream"] - 25.0) < 1e-9  # 0.25 GB at 10 GB/s

    def server(roof, tpot):
        return {"error": None, "startup_s": 1.0, "peak_rss_gib": 0.5, "roofline": roof,
                "workloads": {"W1": {"median": _median(tpot, 0.0), "full_length": True},
                              "W2": {"median": _median(tpot, 300.0), "full_length": True}}}

    results = {"repeats": 1, "workloads": ["W1", "W2"], "machine": {"ceilings": ceilings},
               "servers": {"pyserve": server(halved, 50.0), "pyserve-q4": server(quantized, 0.04)}}
    rows = {(line.split()[0], line.split()[1]): line for line in format_table(results).splitlines()
            if line.startswith("W")}
    assert " 50% " in rows[("W1", "pyserve")]  # 25 ms floor / 50 ms
    assert " 25% " in rows[("W1", "pyserve-q4")]  # 0.01 ms floor / 0.04 ms
    assert " 75% " in rows[("W2", "pyserve")]  # 300 / 400 tok/s


def test_ratios_to_the_first_pyserve_row_when_the_float32_row_is_absent():
    def server(tok_s):
        median = {"output_throughput": tok_s, "median_ttft_ms": 300.0, "median_tpot_ms": 5.0,
                  "total_token_throughput": tok_s}
        return {"error": None, "startup_s": 1.0, "peak_rss_gib": 0.5,
                "workloads": {"W2": {"median": median, "full_length": True}}}

    results = {"repeats": 1, "workloads": ["W2"], "machine": {},
               "servers": {"pyserve-q4": server(300.0), "vllm": server(100.0)}}
    table = format_table(results)
    rows = {line.split()[1]: line.split() for line in table.splitlines() if line.startswith("W2")}
    assert rows["vllm"][3] == "0.33x" and rows["pyserve-q4"][3] == "1.00x"
    assert "/ pyserve-q4's" in table
    # a float32 row that failed (no workloads) leaves the base to the next pyserve row
    results["servers"] = {"pyserve": {**server(1.0), "workloads": {}}, **results["servers"]}
    rows = {line.split()[1]: line.split() for line in format_table(results).splitlines()
            if line.startswith("W2")}
    assert rows["vllm"][3] == "0.33x"
    # no pyserve row at all: no ratios, and the footer says so
    results["servers"] = {"vllm": server(100.0)}
    table = format_table(results)
    assert "None" not in table and [l.split()[3] for l in table.splitlines() if l.startswith("W2")] == ["-"]
    assert "no pyserve row, so no ratios" in table and "figure /" not in table
