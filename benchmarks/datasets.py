"""Prompt sets for the benchmarks, sampled with `vllm bench`'s dataset flags and meanings:

- random: each prompt is random token ids (no special tokens), decoded to text. Its
  length is drawn uniformly from [len * (1 - r), len * (1 + r)] (r = --random-range-ratio, the
  same draw for the output length), after an optional --random-prefix-len prefix that every
  prompt shares.
- sharegpt: the first two turns of each conversation in a ShareGPT-format JSON file (a list of
  {"conversations": [{"value": ...}, ...]}); the reply's length is the output length unless
  --sharegpt-output-len is given; too short or too long pairs are skipped as vLLM skips them.
- prefix-repetition: --prefix-repetition-num-prefixes random prefixes, each followed by a
  fresh random suffix, so a server's prefix cache has something to find.

Invariant: a prompt's text encodes (without special tokens) to exactly `prompt_token_ids`,
and `prompt_len` is their count. Decoding random ids and encoding the text again does not
always give the same ids back (BPE merges across token boundaries), so each generated piece is
decoded, re-encoded and cut or topped up until it round-trips; after a few tries the last
encoding is kept and its true length is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "sharegpt", "prefix-repetition")


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    prompt_token_ids: list[int]


def load_tokenizer(path: str):
    """The Hugging Face tokenizer in a local model directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many kinds here
        raise SystemExit(f"cannot load a tokenizer from '{path}': pass --tokenizer with a local "
                         f"model directory that holds tokenizer.json ({exc})") from None


def _allowed_ids(tokenizer) -> np.ndarray:
    """Ids to draw prompts from: no special tokens, and no byte-level token that is only part
    of a UTF-8 character (it decodes to U+FFFD, which encodes to other tokens, so prompts
    holding one rarely round-trip to their length)."""
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(tokenizer.vocab_size)])
    return np.array([i for i, text in enumerate(texts) if i not in special and "\ufffd" not in text])


def fit_to_length(tokenizer, ids: list[int], target: int, allowed: np.ndarray,
                  rng: np.random.Generator, max_retry: int = 10) -> tuple[str, list[int]]:
    """(text, ids) with encode(text) == ids and, unless the retries run out, len(ids) == target."""
    for attempt in range(max_retry + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target or attempt == max_retry:
            return text, ids
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + allowed[rng.integers(0, len(allowed), target - len(ids))].tolist()
    raise AssertionError("unreachable")


def _length_range(mean: int, ratio: float, low_floor: int) -> tuple[int, int]:
    return max(low_floor, math.floor(mean * (1 - ratio))), max(low_floor, math.ceil(mean * (1 + ratio)))


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    # vLLM counts the special tokens the tokenizer adds (a BOS) as part of the input length
    real_input = max(0, input_len - tokenizer.num_special_tokens_to_add())
    in_lo, in_hi = _length_range(real_input, range_ratio, 0)
    out_lo, out_hi = _length_range(output_len, range_ratio, 1)
    if prefix_len + in_lo < 1:
        raise ValueError("--random-input-len is too small: a prompt could have no tokens")
    input_lens = rng.integers(in_lo, in_hi + 1, num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, num_prompts)
    prefix: list[int] = []
    if prefix_len > 0:
        _, prefix = fit_to_length(tokenizer, allowed[rng.integers(0, len(allowed), prefix_len)].tolist(),
                                  prefix_len, allowed, rng)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        body = allowed[rng.integers(0, len(allowed), n_in)].tolist()
        text, ids = fit_to_length(tokenizer, prefix + body, len(prefix) + n_in, allowed, rng)
        requests.append(SampleRequest(text, len(ids), n_out, ids))
    return requests


def _valid_pair(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    # vLLM's ShareGPT pruning: at least 4 tokens each way, prompt <= 1024, both <= 2048
    too_short = prompt_len < 4 or (not fixed_output and output_len < 4)
    return not too_short and prompt_len <= 1024 and prompt_len + output_len <= 2048


def sharegpt_requests(tokenizer, path: str, num_prompts: int, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--dataset-path {path}: cannot read a ShareGPT JSON file ({exc})") from None
    pairs = [e["conversations"] for e in data
             if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    rand = random.Random(seed)
    rand.shuffle(pairs)
    requests = []
    for conv in pairs:
        if len(requests) == num_prompts:
            break
        prompt, completion = conv[0]["value"], conv[1]["value"]
        ids = tokenizer(prompt).input_ids
        n_out = len(tokenizer(completion).input_ids) if output_len is None else output_len
        if _valid_pair(len(ids), n_out, output_len is not None):
            requests.append(SampleRequest(prompt, len(ids), n_out, ids))
    if not requests:
        raise SystemExit(f"--dataset-path {path}: no conversation has a usable first exchange "
                         "(4..1024 prompt tokens, at most 2048 with the reply)")
    # too few usable pairs: repeat random ones, as vLLM oversamples
    requests += [rand.choice(requests) for _ in range(num_prompts - len(requests))]
    return requests


def prefix_repetition_requests(tokenizer, num_prompts: int, prefix_len: int, suffix_len: int,
                               num_prefixes: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)

    def piece(length: int) -> list[int]:
        return fit_to_length(tokenizer, allowed[rng.integers(0, len(allowed), length)].tolist(),
                             length, allowed, rng)[1]

    prefixes = [piece(prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):  # round robin: exactly num_prompts, prefixes used evenly
        ids = prefixes[i % num_prefixes] + piece(suffix_len)
        requests.append(SampleRequest(tokenizer.decode(ids), len(ids), output_len, ids))
    random.Random(seed).shuffle(requests)
    return requests


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 1000,
                     dataset_name: str | None = "random") -> None:
    g = parser.add_argument_group("datasets (as vllm bench)")
    g.add_argument("--dataset-name", default=dataset_name,
                   choices=DATASETS + ("prefix_repetition",),
                   help="prompt set (prefix_repetition is vLLM's spelling of prefix-repetition)")
    g.add_argument("--dataset-path", help="ShareGPT-format JSON file for --dataset-name sharegpt")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are drawn from [len*(1-r), len*(1+r)]")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one random prefix shared by every random prompt")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length for every ShareGPT request (default: the reply's)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)


def sample_requests(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """The prompts add_dataset_args's flags (and --seed) ask for."""
    name = args.dataset_name.replace("_", "-")
    if name != "sharegpt" and args.dataset_path is not None:
        raise SystemExit(f"--dataset-path is for --dataset-name sharegpt, not {name}")
    if name == "random":
        return random_requests(tokenizer, args.num_prompts, args.random_input_len,
                               args.random_output_len, args.random_range_ratio,
                               args.random_prefix_len, args.seed)
    if name == "sharegpt":
        if args.dataset_path is None:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts,
                                 args.sharegpt_output_len, args.seed)
    return prefix_repetition_requests(
        tokenizer, args.num_prompts, args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
        args.prefix_repetition_output_len, args.seed)
