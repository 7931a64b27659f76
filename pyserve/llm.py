"""Offline generation and embeddings, as vLLM's LLM: every prompt goes through the engine
together."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from pyserve.config import Config
from pyserve.engine import beam_driver
from pyserve.engine.beam_search import BeamSearchOutput
from pyserve.engine.core import EngineCore
from pyserve.engine.output import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pyserve.pooling_params import PoolingParams
from pyserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pyserve.executor.multiproc import refuse_in_bootstrapping_child
from pyserve.tokenizer.tokenizer import apply_chat_template

Prompt = str | list[int] | dict


class LLM:
    """LLM(model=None, **flags): flags take the CLI's names in snake case
    (dtype="float32", max_model_len=2048, kv_cache_memory=1 << 30, ...)."""

    def __init__(self, model: str | None = None, **flags):
        config = Config.from_flat(model=model, **flags)
        if config.parallel.tensor_parallel_size > 1:
            refuse_in_bootstrapping_child()  # before a worker re-running a script loads a model
        self.engine = EngineCore(config)
        self.config = self.engine.config  # with what the engine resolved (the step budget)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops tensor-parallel worker processes now (they also stop when this LLM is
        garbage-collected, or at exit)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):  # {"prompt_token_ids": [...]} or {"prompt": "..."}
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._token_ids(prompt["prompt"])
        return None, list(prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults, as vLLM's."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        # offline use wants only each request's final output
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        return self._run(prompts, lambda i, rid, ids, text: self.engine.add_request(
            rid, ids, params[i], prompt=text, priority=priority[i] if priority else 0))

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, pooled as the server's /v1/embeddings pools (vLLM's
        LLM.embed): outputs.embedding is a list of floats."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        outputs = self._run(prompts, lambda i, rid, ids, text: self.engine.add_pooling_request(
            rid, ids, params, prompt=text))
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.pooled.tolist()),
                                       o.prompt_token_ids, o.finished) for o in outputs]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (engine/beam_search.py): per prompt a BeamSearchOutput, its
        sequences the best beams, best first (tokens: prompt and generated; text: all of them
        decoded; cum_logprob; logprobs). concurrency_limit: prompts searched together."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        searches = [beam_driver.start(self.engine, self._token_ids(p)[1], params) for p in prompts]
        step = concurrency_limit or max(len(searches), 1)
        outputs: list[BeamSearchOutput] = []
        for at in range(0, len(searches), step):
            outputs += beam_driver.run_offline(self.engine, searches[at:at + step],
                                               f"beam-{next(self._ids)}")
        return outputs

    def _run(self, prompts, add) -> list[RequestOutput]:
        """add(index, request id, token ids, text) admits each prompt; then the engine steps
        until all are done (all aborted if anything fails)."""
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                text, token_ids = self._token_ids(prompt)
                request_id = str(next(self._ids))
                add(i, request_id, token_ids, text)
                ids.append(request_id)
            outputs: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    outputs[out.request_id] = out
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return [outputs[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": apply_chat_template(tokenizer, c)} for c in conversations]
        return self.generate(prompts, sampling_params)
