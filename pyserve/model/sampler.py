"""Next-token choice for a batch, on the logits' device, in vLLM's order:

  raw logprobs (for `logprobs`) <- log_softmax(logits)
  logits += logit_bias; EOS/stop tokens banned below min_tokens
  penalties: repetition (prompt + output tokens), frequency and presence (output tokens)
  greedy rows: argmax
  random rows: / temperature -> top-k -> top-p -> softmax -> min-p -> sample

Sampling inverts the cumulative distribution: one uniform u per row picks the first token whose
running sum of weights (float64) passes u times their total. That draws from p as the
exponential race (argmax of p / E, E ~ Exp(1)) does, with one random number a row instead of
one per vocabulary entry, whose logarithms cost a CPU decode step of 16 rows a sixth of its
time. A seeded request draws its u from its own generator, so its tokens do not depend on what
else is in the batch.

On the CPU the penalties, the whole choice (argmax; or scaling, top-k, top-p, min-p and the
draw) and the logprobs are native passes over each row (csrc/cpu/sampling.cpp; top-k / top-p
find their cut without sorting the vocabulary); CUDA runs the PyTorch ops below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pyserve import _native
from pyserve.step import SampledLogprobs, SamplerOutput, SamplingInputs
from pyserve.structured.bitmask import apply_bitmask


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [S], 1.0 on greedy rows
    greedy: torch.Tensor  # [S] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [S] int, vocab size where off
    top_p: torch.Tensor | None  # [S]
    min_p: torch.Tensor | None  # [S]
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    penalties: Penalties | None
    generators: list[torch.Generator | None]
    max_num_logprobs: int  # -1: no row wants logprobs
    # structured outputs: (int32 bitmask [S, ceil(V / 32)], the rows it constrains), or None
    grammar: tuple[torch.Tensor, list[int]] | None = None


@dataclass
class Penalties:
    """Each row's penalties and the token histories they read, as flat id lists: row r's are
    ids[offsets[r]:offsets[r + 1]] (a row without penalties has none)."""

    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    repetition: torch.Tensor  # [S] float32
    seen_ids: torch.Tensor  # prompt and output tokens (repetition), int64, repeats allowed
    seen_offsets: torch.Tensor  # [S + 1] int64
    output_ids: torch.Tensor  # output tokens (frequency counts them, presence sees them), int64
    output_offsets: torch.Tensor  # [S + 1] int64


def _penalties(requests: list[SamplingInputs], device: torch.device) -> Penalties:
    seen, output, seen_offsets, output_offsets = [], [], [0], [0]
    for r in requests:
        if r.params.penalized:
            seen += r.prompt_token_ids
            seen += r.output_token_ids
            output += r.output_token_ids
        seen_offsets.append(len(seen))
        output_offsets.append(len(output))
    f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
    return Penalties(torch.tensor([r.params.presence_penalty for r in requests], **f32),
                     torch.tensor([r.params.frequency_penalty for r in requests], **f32),
                     torch.tensor([r.params.repetition_penalty for r in requests], **f32),
                     torch.tensor(seen, **i64), torch.tensor(seen_offsets, **i64),
                     torch.tensor(output, **i64), torch.tensor(output_offsets, **i64))


def build_metadata(requests: list[SamplingInputs], generators: list[torch.Generator | None],
                   vocab: int, device: torch.device, grammar=None) -> SamplingMetadata:
    """On the event loop: plain per-request sampling inputs -> batched tensors. generators[i]:
    request i's own generator (seeded), or None (the runner's default); grammar: a step's
    token bitmask and the rows it constrains."""
    params = [r.params for r in requests]
    f32 = dict(dtype=torch.float32, device=device)
    greedy = [p.greedy for p in params]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    bias_rows, bias_ids, bias_values = [], [], []
    for row, r in enumerate(requests):
        for token, value in (r.params.logit_bias or {}).items():
            if 0 <= token < vocab:
                bias_rows.append(row), bias_ids.append(token), bias_values.append(value)
        if r.num_output_tokens < r.params.min_tokens:
            for token in (*r.eos_token_ids, *r.params.stop_token_ids):
                if token < vocab:
                    bias_rows.append(row), bias_ids.append(token), bias_values.append(float("-inf"))
    penalties = _penalties(requests, device) if any(p.penalized for p in params) else None
    return SamplingMetadata(
        temperature=torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], **f32),
        greedy=torch.tensor(greedy, device=device),
        all_greedy=all(greedy),
        top_k=torch.tensor(top_k, device=device) if any(k < vocab for k in top_k) else None,
        top_p=(torch.tensor([p.top_p for p in params], **f32)
               if any(p.top_p < 1.0 for p in params) else None),
        min_p=(torch.tensor([p.min_p for p in params], **f32)
               if any(p.min_p > 0.0 for p in params) else None),
        bias=(torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device),
              torch.tensor(bias_values, **f32)) if bias_rows else None,
        penalties=penalties,
        generators=list(generators),
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        grammar=grammar,
    )


def _apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition (each token seen in the prompt or output: positive logits divided by it,
    negative ones multiplied), then frequency and presence (each output token: minus frequency
    times its count, minus presence): a new tensor, the raw logits stay for logprobs. On the
    CPU one native pass over the histories; elsewhere the dense form, bitwise the same."""
    if logits.is_cpu:
        out = logits.contiguous().clone()
        _native.apply_penalties(out, penalties.presence, penalties.frequency, penalties.repetition,
                                penalties.seen_ids, penalties.seen_offsets, penalties.output_ids,
                                penalties.output_offsets)
        return out
    return _apply_penalties_dense(logits, penalties)


def _apply_penalties_dense(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    S, V = logits.shape

    def rows_of(offsets: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(S, device=logits.device), offsets.diff())

    def in_vocab(ids: torch.Tensor, offsets: torch.Tensor):  # the native pass skips the others
        rows = rows_of(offsets)
        keep = (ids >= 0) & (ids < V)
        return rows[keep], ids[keep]

    seen = torch.zeros(S, V, dtype=torch.bool, device=logits.device)
    seen[in_vocab(penalties.seen_ids, penalties.seen_offsets)] = True
    counts = torch.zeros(S, V, device=logits.device)
    rows, ids = in_vocab(penalties.output_ids, penalties.output_offsets)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
    rep = penalties.repetition[:, None].expand_as(logits)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    return logits - penalties.frequency[:, None] * counts - penalties.presence[:, None] * (counts > 0)


def _top_k_top_p(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(positions[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
        drop = before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _uniforms(generators, default: torch.Generator, device: torch.device) -> torch.Tensor:
    """[rows] float64 in [0, 1): unseeded rows from the default generator, a seeded row from its
    own, drawn on that generator's device (a seeded request's generator lives on the CPU, so its
    tokens do not depend on the device)."""
    u = torch.rand(len(generators), generator=default, device=default.device, dtype=torch.float64)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if seeded:
        own = torch.cat([torch.rand(1, generator=generators[i], device=generators[i].device,
                                    dtype=torch.float64).cpu() for i in seeded])
        u[seeded] = own.to(u.device)
    return u.to(device)


def _draw(weights: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """weights [S, V] >= 0, not normalized; u [S] in [0, 1) -> one token a row, token i with
    probability weights[i] / sum(weights). fallback: a token of positive weight per row, taken
    in the rare case rounding puts u * total at the very end of the cumulative sum."""
    cdf = weights.double().cumsum(dim=-1)
    target = u[:, None] * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)
    return torch.where(weights.gather(1, drawn[:, None]).squeeze(1) > 0, drawn, fallback)


class TopLogprobs(NamedTuple):
    values: torch.Tensor  # [S, k] logprobs, largest first
    indices: torch.Tensor  # [S, k] token ids


def logprob_columns(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """The one logprob computation, for sampled and prompt rows alike: logits [S, V] and one
    target token a row -> (its logprob [S, 1], its rank [S, 1] (1 = the most likely), and the
    k most likely (values and indices, as torch.topk's) or None for k = 0). On the CPU one
    native pass a row, without the [S, V] log_softmax (prompt logprobs have a row per prompt
    token)."""
    if logits.is_cpu:
        picked, ranks, ids, values = _native.logprob_columns(logits.float().contiguous(),
                                                             targets.long().contiguous(), k)
        return picked[:, None], ranks[:, None], TopLogprobs(values, ids) if k > 0 else None
    logprobs = logits.log_softmax(dim=-1)
    picked = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > picked).sum(dim=-1, keepdim=True) + 1
    return picked, ranks, logprobs.topk(k, dim=-1) if k > 0 else None


def result_table(raw: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """Everything the host needs from the sampler in one tensor, so that it crosses to the
    host in one copy: without logprobs (k < 0) the chosen ids [S] (int64); with them one
    float64 table (exact for float32 values and for ids and ranks below 2**53) of rows
    [chosen, logprob, rank, top-k ids..., top-k logprobs...]."""
    if k < 0:
        return chosen
    picked, ranks, top = logprob_columns(raw, chosen, k)
    columns = [chosen[:, None], picked, ranks]
    if top is not None:
        columns += [top.indices, top.values]
    return torch.cat([c.double() for c in columns], dim=1)


def read_result_table(table: torch.Tensor, k: int) -> SamplerOutput:
    """A host copy of result_table's tensor -> the sampler's output."""
    if k < 0:
        return SamplerOutput(table.tolist(), None)
    rows = table.tolist()
    return SamplerOutput([int(row[0]) for row in rows], SampledLogprobs(
        [row[1] for row in rows], [int(row[2]) for row in rows],
        [[int(i) for i in row[3:3 + k]] for row in rows], [row[3 + k:] for row in rows]))


def sample_on_device(logits: torch.Tensor, meta: SamplingMetadata, default: torch.Generator) -> torch.Tensor:
    """logits: [S, vocab] float32 -> the result table (see result_table), on the logits'
    device, without waiting for it. A grammar's bitmask goes first, so logprobs, penalties and
    every draw see only the tokens it allows (vLLM's order)."""
    if meta.grammar is not None:
        bitmask, rows = meta.grammar
        apply_bitmask(logits, bitmask, rows)
    raw = logits
    if meta.bias is not None:
        rows, ids, values = meta.bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if meta.penalties is not None:
        logits = _apply_penalties(logits, meta.penalties)
    u = None if meta.all_greedy else _uniforms(meta.generators, default, logits.device)
    if logits.is_cpu:
        chosen = _choose_on_cpu(logits, meta, meta.greedy, u)
    else:
        chosen = logits.argmax(dim=-1)
        if u is not None:
            weights, fallback = _weights(logits, meta)
            chosen = torch.where(meta.greedy, chosen, _draw(weights, u, fallback))
    return result_table(raw, chosen, meta.max_num_logprobs)


def _choose_on_cpu(logits: torch.Tensor, meta: SamplingMetadata, greedy: torch.Tensor,
                   u: torch.Tensor | None) -> torch.Tensor:
    """The token of each row as the PyTorch steps of sample_on_device choose it (greedy rows:
    argmax; the others: temperature, top-k, top-p, min-p, the inverse-CDF draw at u), in one
    native call."""
    chosen = torch.empty(logits.shape[0], dtype=torch.int64)
    _native.sample_tokens(chosen, logits.contiguous(), greedy.contiguous(), meta.temperature,
                          meta.top_k, meta.top_p, meta.min_p, u)
    return chosen


def _weights(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the sampling distribution, unnormalized [S, V]: temperature, top-k, top-p, min-p;
    a token of weight 1 per row, for _draw's fallback)."""
    scaled = logits / meta.temperature[:, None]
    if meta.top_k is not None or meta.top_p is not None:
        scaled = _top_k_top_p(scaled, meta.top_k, meta.top_p)
    # softmax without its division: the most likely token weighs 1, so min-p's floor is
    # min_p itself; the argmax of scaled is a token of weight 1 for _draw's fallback
    top = scaled.max(dim=-1, keepdim=True)
    weights = (scaled - top.values).exp_()
    if meta.min_p is not None:
        weights = weights.masked_fill_(weights < meta.min_p[:, None], 0.0)
    return weights, top.indices.squeeze(1)


def draft_verdicts(logits: torch.Tensor, meta: SamplingMetadata, drafts: torch.Tensor,
                   default: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of proposals that are certain (prompt lookup proposes one token, so its
    draft distribution q is a point mass): each row draws its token from p exactly as plain
    sampling would, with one uniform a row, and the draft x is kept when the draw is x. That
    keeps x with probability p(x) = min(1, p(x) / q(x)) and otherwise yields a draw from p
    without x, the residual max(p - q, 0): rejection sampling's outcome (vLLM's), and, for a
    seeded request whose generator gives row i the uniform plain sampling would give its
    i-th next token, the very tokens it would sample without speculation. A row without a
    draft (drafts < 0: the last row) just draws. logits [R, V] (no penalties: their history
    changes along the drafts) -> (accepted [R] bool, the token drawn [R])."""
    u = _uniforms(meta.generators, default, logits.device)
    if logits.is_cpu:
        drawn = _choose_on_cpu(logits, meta, torch.zeros(logits.shape[0], dtype=torch.bool), u)
    else:
        weights, fallback = _weights(logits, meta)
        drawn = _draw(weights, u, fallback)
    return (drafts >= 0) & (drawn == drafts), drawn


def sample(logits: torch.Tensor, meta: SamplingMetadata, default: torch.Generator) -> SamplerOutput:
    """logits: [S, vocab] float32 -> one token per row (and logprobs if asked)."""
    table = sample_on_device(logits, meta, default)
    return read_result_table(table.cpu(), meta.max_num_logprobs)  # the step's one host copy
