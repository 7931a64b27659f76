"""Embeddings: throughput against sentence-transformers on the same weights, and the latency of a
lone embedding request while generation streams run.

    python -m benchmarks.embeddings [--texts 1000] [--batch-size 32] [--streams 16]
        [--skip-decoder] [--skip-bert] [--skip-latency]

Throughput: --texts short texts (6 to 24 words, seeded), embedded --batch-size at a time by
pyserve's offline engine (LLM.embed: the scheduler's batches, our kernels) and by
sentence-transformers' encode(batch_size=...) in the same process, one after the other, on

- the default model (SmolLM2-135M-Instruct): pyserve serves its GGUF weights (Q8_0 / Q4_1
  kept quantized, float32 activations); sentence-transformers runs transformers on the
  float32 directory they were converted to (the same numbers: the kernels are bitwise the
  float32 model's), pooled as vLLM pools a causal LM: last token, normalized; a second row
  with --gguf-activations int8 (the layers' inputs rounded to int8 for integer dot
  products, llama.cpp's arithmetic) where the CPU has that kernel (AVX2, AVX-512 VNNI), and
  one with --dtype bfloat16 (steps' GEMMs in bfloat16) where the CPU has AMX or AVX-512 BF16;
- a BERT of all-MiniLM-L6-v2's shape (6 layers, hidden 384, 12 heads, random weights made by
  tools/make_tiny_bert.py: no model hub here), mean pooling, normalized, from its
  sentence-transformers directory; where the CPU has AMX (whose default GEMMs are then
  bfloat16x3, --encoder-matmul-precision high) a float32 row (highest) too, and with AMX or
  AVX-512 BF16 a --dtype bfloat16 row.

Both sides get a warm-up pass first; each figure is the best of --repeats passes. Cosine
agreement of the two sides' embeddings is printed too.

Latency: a server on the default model; the median of 5 lone /v1/embeddings requests on the
idle server, then the same while --streams completions (256 tokens each, ignore_eos) stream,
against how long those generations take: an embedding that waited for them would take that
long."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from it an be this which are or "
         "model server token batch cache block prefix kernel memory thread request stream "
         "paris tokyo france japan river mountain city music garden window coffee winter "
         "quickly slowly brightly carefully build measure embed answer write read").split()
MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512)


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24))).capitalize() + "."
            for _ in range(n)]


def best_rate(run, n: int, repeats: int) -> tuple[float, object]:
    """(items per second of the fastest pass, the last pass's result), after a warm-up."""
    result = run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - t0)
    return n / best, result


def throughput(name: str, model_dir: Path, st_model, items: list[str], batch: int,
               repeats: int, variants: dict[str, dict]) -> None:
    """One line a variant (a label and its LLM flags) against sentence-transformers' one run."""
    import torch

    from pyserve.llm import LLM

    batches = [items[i: i + batch] for i in range(0, len(items), batch)]
    rows = []
    for label, flags in variants.items():
        llm = LLM(str(model_dir) if model_dir else None, **flags)
        rate, ours = best_rate(
            lambda: [o.outputs.embedding for b in batches for o in llm.embed(b)], len(items), repeats)
        llm.shutdown()
        del llm
        rows.append((label, rate, ours))
    theirs_rate, theirs = best_rate(
        lambda: st_model.encode(items, batch_size=batch, convert_to_numpy=True), len(items), repeats)
    for label, rate, ours in rows:
        cos = torch.nn.functional.cosine_similarity(torch.tensor(ours), torch.from_numpy(theirs), dim=1)
        print(f"{name}{label}: pyserve {rate:8.1f} embeddings/s   sentence-transformers "
              f"{theirs_rate:8.1f} embeddings/s   ratio {rate / theirs_rate:.2f}x   "
              f"cosine min {cos.min().item():.6f}", flush=True)


def decoder_reference(model_dir: Path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    # text only: sentence-transformers 6 would otherwise wrap each text in the chat template
    transformer = Transformer(str(model_dir), modality_config={"text": {
        "method": "forward", "method_output_name": "last_hidden_state"}},
        module_output_name="token_embeddings")
    tokenizer = transformer.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")


async def lone_latency(url: str, streams: int, samples: int = 5) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def embed() -> float:
            t0 = time.perf_counter()
            async with session.post(url + "/v1/embeddings", json={"input": "How long does a "
                                    "lone embedding wait while others generate?"}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            return time.perf_counter() - t0

        async def generate() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 256, "ignore_eos": True,
                    "stream": True, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as r:
                async for _ in r.content:
                    pass

        await embed()
        idle = statistics.median([await embed() for _ in range(samples)])
        t0 = time.perf_counter()
        running = [asyncio.create_task(generate()) for _ in range(streams)]
        await asyncio.sleep(2.0)  # every stream admitted and decoding
        loaded = []
        for _ in range(samples):
            loaded.append(await embed())
        await asyncio.gather(*running)
        generation = time.perf_counter() - t0
    print(f"lone embedding latency: idle {1000 * idle:.1f} ms   under {streams} streams "
          f"{1000 * statistics.median(loaded):.1f} ms (median of {samples})   "
          f"the streams' generation {generation:.1f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embeddings", description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--skip-decoder", action="store_true")
    p.add_argument("--skip-bert", action="store_true")
    p.add_argument("--skip-latency", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    items = texts(args.texts)
    from pyserve import _native
    from pyserve.cli import parse_config
    from pyserve.model.default_model import ensure_default_model
    from pyserve.model.layers.linear import bf16_gemm_supported

    default_dir = ensure_default_model(parse_config([]).model.download_dir)
    if not args.skip_decoder:
        variants = {"": dict(max_model_len=2048)}
        if _native.int8_dot_supported():
            variants[", --gguf-activations int8"] = dict(max_model_len=2048, gguf_activations="int8")
        if bf16_gemm_supported():
            variants[", --dtype bfloat16"] = dict(max_model_len=2048, dtype="bfloat16")
        throughput("default model (SmolLM2-135M, last token)", None, decoder_reference(default_dir),
                   items, args.batch_size, args.repeats, variants)
    if not args.skip_bert:
        from make_tiny_bert import make_tiny_bert
        from sentence_transformers import SentenceTransformer

        bert = make_tiny_bert(Path(tempfile.mkdtemp(prefix="bench-bert-")), "bert", "mean",
                              overrides=MINILM)
        variants = {"": {}}
        if _native.bf16x3_supported():  # the default's GEMMs are bfloat16x3: float32's beside
            variants[", --encoder-matmul-precision highest"] = dict(encoder_matmul_precision="highest")
        if bf16_gemm_supported():
            variants[", --dtype bfloat16"] = dict(dtype="bfloat16")
        throughput("BERT (MiniLM-L6 shape, mean)", bert, SentenceTransformer(str(bert), device="cpu"),
                   items, args.batch_size, args.repeats, variants)
    if not args.skip_latency:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.e2e.server import ServerProcess

        server = ServerProcess("--max-model-len", "2048")
        try:
            asyncio.run(lone_latency(server.url, args.streams))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
