"""What `python -m pyserve` does until the HTTP server lands: loads the model and answers a
chat question offline, through the same engine the server will use."""

from __future__ import annotations

import logging
import sys
import time

from pyserve.config import Config
from pyserve.model.errors import ModelLoadError

QUESTION = "What is the capital of France, and what is it famous for?"


def run_demo(config: Config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pyserve.engine.core import EngineCore
    from pyserve.engine.sampling_params import SamplingParams
    from pyserve.tokenizer.tokenizer import apply_chat_template

    print("pyserve: the HTTP server is not built yet; running the offline generation demo.",
          flush=True)
    try:
        engine = EngineCore(config)
    except ModelLoadError as exc:
        print(f"pyserve: error: {exc}", file=sys.stderr)
        return 1
    messages = [{"role": "user", "content": QUESTION}]
    ids = apply_chat_template(engine.tokenizer, messages)
    engine.add_request("demo", ids, SamplingParams(temperature=0.0, max_tokens=128))
    start = time.perf_counter()
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    elapsed = time.perf_counter() - start
    out = outputs[0].outputs[0]
    print(f"\nUser: {QUESTION}\nAssistant: {out.text.strip()}\n")
    print(f"({len(out.token_ids)} tokens in {elapsed:.2f}s, finish_reason={out.finish_reason})")
    return 0
