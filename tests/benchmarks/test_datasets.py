"""benchmarks/datasets.py with the real tokenizer of the tiny test model."""

import json
from collections import defaultdict

import pytest

from benchmarks.datasets import (prefix_repetition_requests, random_requests,
                                 sharegpt_requests)


def test_random_lengths_lie_in_the_range(tokenizer):
    requests = random_requests(tokenizer, 40, input_len=16, output_len=8, range_ratio=0.5, seed=1)
    assert len(requests) == 40
    assert all(8 <= r.prompt_len <= 24 for r in requests)
    assert all(4 <= r.expected_output_len <= 12 for r in requests)
    assert len({r.prompt_len for r in requests}) > 5  # drawn, not fixed
    special = set(tokenizer.all_special_ids)
    for r in requests:  # the text is what the server will see: it encodes to the ids counted
        assert tokenizer.encode(r.prompt, add_special_tokens=False) == r.prompt_token_ids
        assert len(r.prompt_token_ids) == r.prompt_len and not special & set(r.prompt_token_ids)


def test_random_without_range_is_exact_and_seeded(tokenizer):
    a = random_requests(tokenizer, 6, input_len=12, output_len=5, seed=7)
    assert [(r.prompt_len, r.expected_output_len) for r in a] == [(12, 5)] * 6
    assert [r.prompt for r in a] == [r.prompt for r in random_requests(tokenizer, 6, 12, 5, seed=7)]
    assert [r.prompt for r in a] != [r.prompt for r in random_requests(tokenizer, 6, 12, 5, seed=8)]
    shared = random_requests(tokenizer, 4, input_len=8, output_len=2, prefix_len=10, seed=2)
    assert len({tuple(r.prompt_token_ids[:9]) for r in shared}) == 1
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(tokenizer, 1, 8, 2, range_ratio=1.0)


def test_prefix_repetition_prompts_share_their_prefix(tokenizer):
    requests = prefix_repetition_requests(tokenizer, 12, prefix_len=20, suffix_len=6,
                                          num_prefixes=3, output_len=4, seed=0)
    assert len(requests) == 12 and all(r.expected_output_len == 4 for r in requests)
    groups = defaultdict(list)
    for r in requests:
        groups[tuple(r.prompt_token_ids[:20])].append(r)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    for group in groups.values():
        # what the server tokenizes shares the prefix too (a merge may cross its last token)
        starts = {tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:19]) for r in group}
        assert len(starts) == 1
        assert len({r.prompt for r in group}) == 4  # the suffixes differ


def test_sharegpt_takes_first_exchanges_and_prunes(tokenizer, tmp_path):
    long_text = "The quick brown fox jumps over the lazy dog. " * 3
    data = [{"conversations": [{"from": "human", "value": long_text},
                               {"from": "gpt", "value": "Paris is the capital of France."}]},
            {"conversations": [{"from": "human", "value": "Hi"},  # too short: pruned
                               {"from": "gpt", "value": "Hello, world! How are you today?"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"id": "no conversations"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(tokenizer, str(path), 3)
    assert len(requests) == 3  # the one usable pair, oversampled as vLLM does
    r = requests[0]
    assert r.prompt == long_text and r.prompt_len == len(tokenizer(long_text).input_ids)
    assert r.expected_output_len == len(tokenizer("Paris is the capital of France.").input_ids)
    assert sharegpt_requests(tokenizer, str(path), 1, output_len=2)[0].expected_output_len == 2
    with pytest.raises(SystemExit, match="cannot read"):
        sharegpt_requests(tokenizer, str(tmp_path / "missing.json"), 1)
