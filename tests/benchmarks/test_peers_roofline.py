"""The peers table's "roof" column: W1 against the server's own bandwidth roofline (the bytes
a decode token reads from its weights file: one embedding row, a mixture of experts' active
share), the batched workloads against the GEMM ceiling."""

from __future__ import annotations

from benchmarks.peers.run import format_table, roofline
from benchmarks.peers.servers import ServerSpec


def _median(tpot_ms: float, total_tok_s: float) -> dict:
    return {"output_throughput": 50.0, "median_ttft_ms": 300.0, "median_tpot_ms": tpot_ms,
            "total_token_throughput": total_tok_s}


def test_a_decode_token_reads_one_embedding_row_and_the_active_experts(tmp_path):
    from make_tiny_gguf import MOE_CONFIG, make_tiny_gguf

    from pyserve.model.gguf import decode_read_bytes

    cfg = MOE_CONFIG
    gguf = make_tiny_gguf(tmp_path / "moe.gguf", "Q8_0", arch="qwen3moe")
    read, total = decode_read_bytes(gguf)
    q8 = 34 / 32  # Q8_0: 34 bytes per 32 weights
    experts = int(3 * cfg["num_experts"] * cfg["moe_intermediate_size"] * cfg["hidden_size"] * q8)
    embedding = int(cfg["vocab_size"] * cfg["hidden_size"] * q8)
    skipped = cfg["num_hidden_layers"] * experts * (cfg["num_experts"] - cfg["num_experts_per_tok"]) // cfg["num_experts"]
    assert read == total - skipped - (embedding - embedding // cfg["vocab_size"])
    assert total < gguf.stat().st_size  # the header and vocabulary are not weights


def test_roof_column_uses_each_servers_own_weights(tmp_path):
    from make_tiny_gguf import make_tiny_gguf

    from pyserve.model.gguf import decode_read_bytes

    gguf = make_tiny_gguf(tmp_path / "model.gguf", "Q8_0")
    read_gb = decode_read_bytes(gguf)[0] / 1e9
    ceilings = {"read_bandwidth_gbs": 10.0, "weight_gb_per_decode_token": 0.5,
                "max_tokens_per_s_compute": 400.0}
    quantized = roofline(ceilings, ServerSpec("q", "", lambda port: [], weights=gguf))
    assert abs(quantized["min_ms_per_token_single_stream"] - read_gb / 10 * 1000) < 1e-12
    halved = roofline(ceilings, ServerSpec("b", "", lambda port: [], weight_scale=0.5))
    assert abs(halved["min_ms_per_token_single_stream"] - 25.0) < 1e-9  # 0.25 GB at 10 GB/s

    def server(roof, tpot):
        return {"error": None, "startup_s": 1.0, "peak_rss_gib": 0.5, "roofline": roof,
                "workloads": {"W1": {"median": _median(tpot, 0.0), "full_length": True},
                              "W2": {"median": _median(tpot, 300.0), "full_length": True}}}

    results = {"repeats": 1, "workloads": ["W1", "W2"], "machine": {"ceilings": ceilings},
               "servers": {"pyserve": server(halved, 50.0),
                           "pyserve-q4": server(quantized, quantized["min_ms_per_token_single_stream"] * 4)}}
    rows = {(line.split()[0], line.split()[1]): line for line in format_table(results).splitlines()
            if line.startswith("W")}
    assert " 50% " in rows[("W1", "pyserve")]  # 25 ms floor / 50 ms
    assert " 25% " in rows[("W1", "pyserve-q4")]  # its floor / four times it
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
