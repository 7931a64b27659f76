"""benchmarks/sampler.py runs every mix through both paths and prints a row for each."""

from benchmarks import sampler


def test_every_mix_prints_a_row(capsys):
    assert sampler.main(["--rows", "1,3", "--vocab", "300", "--repeats", "2", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert len(rows) == 2 * len(sampler.MIXES)
    assert all(line.rstrip().endswith("x") for line in rows)
