"""Offline generation and embeddings, as vLLM's LLM: every prompt goes through the engine
together. Methods take vLLM's keyword arguments: use_tqdm is accepted (no progress bar is
drawn), lora_request must be None (no adapters here). chat() renders conversations with the
chat route's own functions (server/openai/messages.py: plain functions, no server runs), as
vLLM's LLM.chat shares its entrypoints' chat_utils, so that both render a conversation alike."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence

from pyserve.config import Config
from pyserve.engine import beam_driver
from pyserve.engine.beam_search import BeamSearchOutput
from pyserve.engine.core import EngineCore
from pyserve.engine.output import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pyserve.pooling_params import PoolingParams
from pyserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pyserve.executor.multiproc import refuse_in_bootstrapping_child
from pyserve.server.errors import APIError
from pyserve.server.openai.messages import (load_template, template_kwargs, template_messages,
                                             tool_function)
from pyserve.tokenizer.tokenizer import apply_chat_template
from pyserve.vllm_flags import FOREIGN, check_foreign

Prompt = str | list[int] | dict
logger = logging.getLogger("pyserve")


def _no_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: pyserve serves no LoRA adapters")


def _vllm_only_flags(flags: dict) -> None:
    """vLLM's engine arguments that have no use here (trust_remote_code, swap_space, ...):
    taken out of flags with the CLI's warning, or its ValueError for one pyserve refuses."""
    switches = {flag.dest for flag in FOREIGN if flag.action == "switch"}
    dests = {flag.dest for flag in FOREIGN}
    given = {name: flags.pop(name) for name in list(flags) if name in dests}
    # a switch given as False is a switch not given (LLM(enable_lora=False))
    given = {name: v for name, v in given.items() if not (name in switches and v is False)}
    for warning in check_foreign({**dict.fromkeys(dests), **given}):
        logger.warning(warning)


class LLM:
    """LLM(model=None, **flags): flags take the CLI's names in snake case
    (dtype="float32", max_model_len=2048, kv_cache_memory=1 << 30, ...)."""

    def __init__(self, model: str | None = None, **flags):
        _vllm_only_flags(flags)
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

    @property
    def llm_engine(self) -> EngineCore:
        """vLLM's name for the engine (llm.llm_engine.get_tokenizer(), ...)."""
        return self.engine

    def _token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):  # {"prompt_token_ids": [...]} or {"prompt": "..."}
            extra = sorted(k for k, v in prompt.items() if k not in ("prompt", "prompt_token_ids")
                           and v is not None)
            if extra:  # multi_modal_data, cache_salt, ...: never dropped silently
                raise ValueError(f"prompt fields {', '.join(extra)} are not supported: pyserve "
                                 "takes text prompts (prompt, prompt_token_ids)")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._token_ids(prompt["prompt"])
        return None, list(prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults, as vLLM's."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        _no_lora(lora_request)
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        # offline use wants only each request's final output
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        if any(p.allowed_token_ids == [] for p in params):  # allowing nothing is not allowing all
            raise ValueError("allowed_token_ids is not None and empty!")  # vLLM's words, on add
        return self._run(prompts, lambda i, rid, ids, text: self.engine.add_request(
            rid, ids, params[i], prompt=text, priority=priority[i] if priority else 0))

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, lora_request=None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, pooled as the server's /v1/embeddings pools (vLLM's
        LLM.embed): outputs.embedding is a list of floats."""
        _no_lora(lora_request)
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        outputs = self._run(prompts, lambda i, rid, ids, text: self.engine.add_pooling_request(
            rid, ids, params, prompt=text))
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.pooled.tolist()),
                                       o.prompt_token_ids, o.finished) for o in outputs]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (engine/beam_search.py): per prompt a BeamSearchOutput, its
        sequences the best beams, best first (tokens: prompt and generated; text: all of them
        decoded; cum_logprob; logprobs). concurrency_limit: prompts searched together."""
        _no_lora(lora_request)
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
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation rendered as the server's chat route renders it
        (text parts joined, tool calls and results passed to the template), with chat_template
        (a file or inline; else --chat-template's, else the model's), the template's kwargs,
        tools, and a final assistant message continued when continue_final_message."""
        _no_lora(lora_request)
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                             "to True.")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError("chat_template_content_format: pyserve hands the template each "
                             "message's text parts joined into one string (\"string\")")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = load_template(chat_template) or load_template(self.config.server.chat_template)
        try:  # the server's checks (reserved template names, tool shapes), as ValueErrors
            kwargs = template_kwargs({"chat_template_kwargs": chat_template_kwargs or {}})
            for i, tool in enumerate(tools or []):
                tool_function(tool, i)
        except APIError as exc:
            raise ValueError(exc.message) from None
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools is not None:
            kwargs["tools"] = tools
        prompts = []
        for conversation in conversations:
            try:
                cleaned = template_messages({"messages": conversation})
            except APIError as exc:  # the server's check, as an offline caller's error
                raise ValueError(exc.message) from None
            ids = apply_chat_template(self.engine.tokenizer, cleaned, add_generation_prompt,
                                      chat_template=template, **kwargs)
            # RequestOutput.prompt: the rendered prompt, as vLLM's
            prompts.append({"prompt_token_ids": ids, "prompt": self.engine.tokenizer.decode(
                ids, skip_special_tokens=False)})
        return self.generate(prompts, sampling_params)
