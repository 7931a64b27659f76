"""The peers workloads draw fresh prompts for every run: no prefix cache carries a run's
prompts into another repeat or another workload."""

from benchmarks.datasets import random_requests
from benchmarks.peers.workloads import WORKLOADS


def test_every_run_of_every_workload_has_its_own_seed():
    seeds = [w.seed(repeat) for w in WORKLOADS.values() for repeat in range(10)]
    assert len(set(seeds)) == len(seeds)


def test_w2_and_w3_share_a_shape_but_not_prompts(tokenizer):
    w2, w3 = WORKLOADS["W2"], WORKLOADS["W3"]
    shape = w2.args[w2.args.index("--random-input-len") + 1]
    assert w3.args[w3.args.index("--random-input-len") + 1] == shape
    for repeat in range(3):
        first = {tuple(r.prompt_token_ids) for r in random_requests(tokenizer, 8, 24, 4, seed=w2.seed(repeat))}
        second = {tuple(r.prompt_token_ids) for r in random_requests(tokenizer, 8, 24, 4, seed=w3.seed(repeat))}
        assert not first & second
