"""The KV memory of one long Gemma 3 context with and without the hybrid layout (kv/groups.py:
the sliding layers' blocks that fall out of the window go back to the pool), in one run.

The model has Gemma 3 270M's attention shapes (tools/make_tiny_model.py "gemma3-270m-kv": 18
layers, every sixth global, one KV head of 256, windows of 512) on a tiny hidden size, so the
KV bytes are the real model's and the forward is quick; --model DIR takes another checkpoint.
One greedy request of --prompt-tokens random ids and --max-tokens more runs through the
offline engine; the table gives the most KV bytes it held at once (blocks referenced x bytes
per block, read after every step) on each layout, and checks the two outputs are equal.

    python -m benchmarks.kv_window [--prompt-tokens 4000] [--max-tokens 96] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

MIB = 1024**2


def run_layout(model: str, prompt: list[int], max_tokens: int, disabled: bool) -> dict:
    from pyserve import SamplingParams
    from pyserve.config import Config
    from pyserve.engine.core import EngineCore

    core = EngineCore(Config.from_flat(
        model=model, max_model_len=len(prompt) + max_tokens + 16, kv_cache_memory=2 << 30,
        disable_hybrid_kv_cache_manager=disabled, enable_prefix_caching=False))
    core.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    peak, tokens, start = 0, [], time.perf_counter()
    while core.has_unfinished():
        for out in core.step():
            tokens = out.outputs[0].token_ids
        peak = max(peak, core.kv.num_blocks - core.kv.num_free_blocks)
    seconds = time.perf_counter() - start
    groups = core.plan.kv_groups
    result = dict(layout="one table per layer" if groups is None else
                  f"hybrid, {groups.num_groups} groups of {groups.group_size} layers",
                  bytes_per_block=core.plan.bytes_per_block, peak_blocks=peak,
                  peak_bytes=peak * core.plan.bytes_per_block, tokens=tokens, seconds=seconds)
    core.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", help="a model directory (default: the 270M-shaped tiny Gemma 3)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
            from make_tiny_model import VOCAB_SIZE, make_tiny_model

            model = str(make_tiny_model(Path(tmp), "gemma3-270m-kv"))
            vocab = VOCAB_SIZE
        else:
            import json

            vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 1000)
        rng = random.Random(0)
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        rows = [run_layout(model, prompt, args.max_tokens, disabled) for disabled in (True, False)]
    context = args.prompt_tokens + args.max_tokens
    print(f"KV memory of one {context}-token context ({args.prompt_tokens} prompt + "
          f"{args.max_tokens} generated), greedy, no prefix caching")
    print(f"{'layout':<34} {'bytes/block':>12} {'peak blocks':>12} {'peak KV MiB':>12} "
          f"{'vs plain':>9} {'seconds':>8}")
    for row in rows:
        print(f"{row['layout']:<34} {row['bytes_per_block']:>12,} {row['peak_blocks']:>12,} "
              f"{row['peak_bytes'] / MIB:>12.2f} {row['peak_bytes'] / rows[0]['peak_bytes']:>9.3f} "
              f"{row['seconds']:>8.2f}")
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(f"outputs equal: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
