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
    from pyserve.engine.sampling_params import RequestOutputKind, SamplingParams
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
    params = SamplingParams(temperature=0.0, max_tokens=128, output_kind=RequestOutputKind.DELTA)
    engine.add_request("demo", ids, params)
    print(f"\nUser: {QUESTION}\nAssistant: ", end="", flush=True)
    start = time.perf_counter()
    num_tokens, finish_reason = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            print(out.outputs[0].text, end="", flush=True)
            num_tokens += len(out.outputs[0].token_ids)
            finish_reason = out.outputs[0].finish_reason
    elapsed = time.perf_counter() - start
    print(f"\n\n({num_tokens} tokens in {elapsed:.2f}s, finish_reason={finish_reason})")
    return 0
