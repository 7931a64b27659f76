"""benchmarks/linear.py's int8 tables: the prefill rate by rows and the in-cache reader rates
print a figure for each int8-activation type (on a CPU with an int8 dot-product kernel)."""

import re
import sys

import pytest

from pyserve import _native


def _run(monkeypatch, capsys, *args) -> str:
    from benchmarks.linear import main

    monkeypatch.setattr(sys, "argv", ["benchmarks.linear", *args])
    main()
    return capsys.readouterr().out


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="no int8 dot-product kernel")
def test_int8_prefill_table_has_a_rate_per_type_and_row_count(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "--int8-only", "--int8-rows", "1,8", "--repeats", "1")
    for kind in ("Q4_0", "Q4_K", "Q6_K", "Q8_0"):
        rows = re.findall(rf"^\s+{kind}\s+([\d.]+)\s+([\d.]+)\s*$", out, re.M)
        assert len(rows) == 2 and all(float(v) > 0 for row in rows for v in row), out


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="no int8 dot-product kernel")
def test_reader_rates_include_the_int8_kernels(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "--readers-only")
    int8_line = next(line for line in out.splitlines() if "with int8 activations" in line)
    assert re.search(r"Q6_K\s+\d+\.\d", int8_line) and re.search(r"Q4_K\s+\d+\.\d", int8_line)
