"""benchmarks/kv_window.py runs end to end: both layouts, equal outputs, and the hybrid one
holding less KV once the context is past the 512-token window."""

from benchmarks import kv_window


def test_kv_window_benchmark_prints_both_layouts(capsys):
    kv_window.main(["--prompt-tokens", "700", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "outputs equal: True" in out
    plain, hybrid = [line for line in out.splitlines() if line.startswith(("one table", "hybrid"))]
    assert "6 groups of 3 layers" in hybrid
    assert float(hybrid.split()[-2]) < 1.0 == float(plain.split()[-2])
