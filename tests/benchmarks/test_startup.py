"""benchmarks.peers.startup's arithmetic on recorded start-up times."""

from benchmarks.peers.startup import format_lines, summarize


def test_median_and_ratio_to_the_first_server():
    results = {"pyserve-q4": summarize([2.1, 1.8, 1.9, 4.0, 1.7]),
               "llamacpp-q4": summarize([1.0, 0.9, 1.2])}
    assert results["pyserve-q4"]["median_s"] == 1.9
    assert (results["pyserve-q4"]["min_s"], results["pyserve-q4"]["max_s"]) == (1.7, 4.0)
    lines = format_lines(results)
    assert lines[0].startswith("pyserve-q4") and "1.00x" in lines[0] and "5 starts" in lines[0]
    assert "median   1.00 s" in lines[1] and "0.53x the first" in lines[1]
