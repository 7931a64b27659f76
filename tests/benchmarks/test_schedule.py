"""benchmarks/serve.py's arrival schedule and flag resolution."""

import argparse

import numpy as np
import pytest

from benchmarks.serve import _resolve_endpoint, arrival_times, build_parser, result_path


def gaps(times):
    return np.diff([0.0, *times])


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 5
    assert arrival_times(5, float("inf"), 0.1, np.random.default_rng(0)) == [0.0] * 5


def test_poisson_arrivals_have_the_requested_rate():
    times = arrival_times(4000, 8.0, 1.0, np.random.default_rng(0))
    g = gaps(times)
    assert np.all(g >= 0) and times == sorted(times)
    # rescaled as vLLM: the last request goes out at num / rate, so the mean gap is 1 / rate
    assert times[-1] == pytest.approx(500.0) and g.mean() == pytest.approx(1 / 8)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV 1
    assert arrival_times(50, 8.0, 1.0, np.random.default_rng(3)) == \
        arrival_times(50, 8.0, 1.0, np.random.default_rng(3))
    assert arrival_times(50, 8.0, 1.0, np.random.default_rng(3)) != \
        arrival_times(50, 8.0, 1.0, np.random.default_rng(4))


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_is_the_gamma_shape(burstiness):
    g = gaps(arrival_times(4000, 2.0, burstiness, np.random.default_rng(1)))
    assert g.mean() == pytest.approx(0.5)
    # gamma of shape k: coefficient of variation 1 / sqrt(k)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_infinite_burstiness_is_a_steady_rate():
    assert gaps(arrival_times(4, 2.0, float("inf"), None)) == pytest.approx([0.5] * 4)


@pytest.mark.parametrize("flags,expected", [
    ([], ("openai", "/v1/completions")),
    (["--backend", "vllm"], ("vllm", "/v1/completions")),
    (["--backend", "openai-chat"], ("openai-chat", "/v1/chat/completions")),
    (["--endpoint", "/v1/chat/completions"], ("openai-chat", "/v1/chat/completions")),
    (["--backend", "openai", "--endpoint", "/v1/completions"], ("openai", "/v1/completions")),
])
def test_backend_and_endpoint_follow_each_other(flags, expected):
    assert _resolve_endpoint(build_parser().parse_args(flags)) == expected


def test_mismatched_backend_and_endpoint_are_refused():
    args = build_parser().parse_args(["--backend", "openai", "--endpoint", "/v1/chat/completions"])
    with pytest.raises(SystemExit, match="openai-chat"):
        _resolve_endpoint(args)


def test_result_file_is_named_as_vllm_names_it(tmp_path):
    args = build_parser().parse_args(["--max-concurrency", "16", "--result-dir", str(tmp_path)])
    assert result_path(args, "openai", "/models/SmolLM2/", "20261130-120000") == str(
        tmp_path / "openai-infqps-concurrency16-SmolLM2-20261130-120000.json")
    args = argparse.Namespace(max_concurrency=None, result_filename=None, label="pyserve",
                              request_rate=4.0, result_dir=None)
    assert result_path(args, "openai", "m", "D") == "pyserve-4.0qps-m-D.json"
