"""GPU ceilings and the CUDA path's speed, measured with CUDA events:

- copy: a large device-to-device copy, GB/s counting bytes read plus bytes written (the
  ceiling the other numbers are held to);
- attention: paged-attention decode at a 4k context with Llama-3.1-8B's attention shape (32
  query heads, 8 KV heads, head size 128, bfloat16, block size 16) at batch 1 (the split-KV
  path), 16 and 64: bytes of K and V read / kernel time, and that as a fraction of the copy's
  GB/s. Each call reads other blocks than the last (sets of block tables that together exceed
  the L2), so the K/V come from memory, not the cache;
- model: a Llama-3.1-8B-shaped model (hidden 4096, 32 layers, 32/8 heads, intermediate 14336,
  vocab 128256) with random bfloat16 weights drawn on the device, driven through
  ModelRunner.execute_model with hand-built ForwardInputs already on the device (no tokenizer,
  no engine): decode step time and tokens/s at batch 1, 16, 64 and 256 with 512-token
  contexts, eager and replayed from the extension's CUDA graphs (DecodeGraphs, the serving
  path: host inputs copied into static buffers, the step's logits); prefill tokens/s for 8 prompts of 2048
  tokens in one step; and the batch-1 roofline: bytes of weights a decode step reads (all but
  the embedding table) / the copy's GB/s, and the fraction of it achieved.

    python -m benchmarks.gpu_kernels [--output-json FILE] [--device cuda|cpu] [--dry-run]

--dry-run shrinks every size (a two-layer model, short contexts, few iterations) so that the
whole script runs in seconds, on the CPU too (--device cpu: wall-clock timing, no graphs);
it checks the script, not the machine. The JSON is rewritten after each part, so a failure
late in a run keeps what was measured before it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pyserve import _native
from pyserve.model.arch import ModelArch
from pyserve.model.cuda_graphs import EagerReplay, capture_decode_graphs
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.models.llama import LlamaForCausalLM
from pyserve.model.runner import ForwardInputs, ModelRunner

L2_FLUSH_BYTES = 256 << 20  # comfortably above the H200's 60 MB L2


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    attn_context: int
    attn_batches: tuple[int, ...]
    attn_heads: tuple[int, int, int]  # query heads, KV heads, head size
    block_size: int
    decode_batches: tuple[int, ...]
    decode_context: int
    prefill: tuple[int, int]  # prompts, tokens each
    iters: int
    arch: ModelArch


def llama_arch(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab) -> ModelArch:
    return ModelArch(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=intermediate, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False, sliding_window=None, torch_dtype="bfloat16", bos_token_id=128000,
        eos_token_ids=(128001,))


FULL = Sizes(copy_bytes=2 << 30, attn_context=4096, attn_batches=(1, 16, 64), attn_heads=(32, 8, 128),
             block_size=16, decode_batches=(1, 16, 64, 256), decode_context=512, prefill=(8, 2048),
             iters=20, arch=llama_arch(4096, 32, 32, 8, 128, 14336, 128256))
DRY = Sizes(copy_bytes=64 << 20, attn_context=256, attn_batches=(1, 4), attn_heads=(4, 2, 64),
            block_size=16, decode_batches=(1, 4), decode_context=32, prefill=(2, 64), iters=2,
            arch=llama_arch(128, 2, 4, 2, 64, 256, 512))


class Timer:
    """Seconds per call of fn(i): CUDA events around `iters` back-to-back calls on a GPU,
    wall-clock on the CPU; `warmup` calls first."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def per_call(self, fn, iters: int, warmup: int = 2) -> float:
        for i in range(warmup):
            fn(i)
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            for i in range(iters):
                fn(i)
            return (time.perf_counter() - start) / iters
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    def graph_per_call(self, fn, calls: int, replays: int) -> float | None:
        """fn(0..calls-1) captured once in a CUDA graph, replayed: seconds per call without the
        launch overhead. None on the CPU."""
        if not self.cuda:
            return None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        return self.per_call(lambda _: graph.replay(), replays, warmup=1) / calls


def measure_copy(sizes: Sizes, device, timer: Timer) -> dict:
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    seconds = timer.per_call(lambda _: dst.copy_(src), sizes.iters)
    return {"bytes": sizes.copy_bytes, "seconds": seconds,
            "gbps_read_plus_write": 2 * sizes.copy_bytes / seconds / 1e9}


def measure_attention(sizes: Sizes, dtype, device, timer: Timer, copy_gbps: float) -> dict:
    heads, kv_heads, head_size = sizes.attn_heads
    ctx, bs = sizes.attn_context, sizes.block_size
    blocks_per_seq = math.ceil(ctx / bs)
    elem = torch.empty((), dtype=dtype).element_size()
    cases = []
    for batch in sizes.attn_batches:
        kv_bytes = 2 * batch * ctx * kv_heads * head_size * elem
        sets = max(1, math.ceil(L2_FLUSH_BYTES / kv_bytes)) if device.type == "cuda" else 1
        num_blocks = sets * batch * blocks_per_seq
        gen = torch.Generator(device).manual_seed(0)
        shape = (num_blocks, kv_heads, bs, head_size)
        key_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        value_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        tables = tables.view(sets, batch, blocks_per_seq)
        query = torch.randn(batch, heads, head_size, generator=gen, device=device).to(dtype)
        out = torch.empty_like(query)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)

        def call(i):
            _native.paged_attention(out, query, key_cache, value_cache, tables[i % sets], starts,
                                    seq_lens, head_size ** -0.5)

        eager = timer.per_call(call, sizes.iters * 5)
        graph = timer.graph_per_call(call, sets * max(1, 64 // sets), sizes.iters)
        best = graph if graph is not None else eager
        gbps = kv_bytes / best / 1e9
        cases.append({"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "eager_seconds": eager,
                      "graph_seconds": graph, "gbps": gbps, "fraction_of_copy": gbps / copy_gbps})
        del key_cache, value_cache
    return {"query_heads": heads, "kv_heads": kv_heads, "head_size": head_size, "block_size": bs,
            "dtype": str(dtype).replace("torch.", ""), "cases": cases,
            "note": "gbps = K/V bytes read / time per call (graph replay where available); "
                    "fraction_of_copy = gbps / the copy's read+write GB/s"}


def build_model(arch: ModelArch, dtype, device, max_positions: int) -> LlamaForCausalLM:
    """Random weights drawn where they live (the loader's dummy format draws them on the CPU,
    minutes for 8B parameters): normal(0, 0.02), norms 1."""
    with torch.device(device):
        model = LlamaForCausalLM(arch, max_positions, dtype)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def decode_inputs(batch: int, ctx: int, bs: int, vocab: int, device) -> ForwardInputs:
    """One new token per sequence after `ctx` cached ones; sequence i owns its own blocks."""
    per_seq = ctx // bs + 1
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    slots = tables[:, ctx // bs].long() * bs + ctx % bs
    meta = AttentionMetadata(slots, tables, torch.arange(batch + 1, dtype=torch.int32),
                             torch.full((batch,), ctx + 1, dtype=torch.int32))
    ids = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(batch))
    return ForwardInputs(ids, torch.full((batch,), ctx), meta, torch.arange(batch)).to(device)


def prefill_inputs(prompts: int, length: int, bs: int, vocab: int, device) -> ForwardInputs:
    per_seq = math.ceil(length / bs)
    tables = torch.arange(prompts * per_seq, dtype=torch.int32).view(prompts, per_seq)
    positions = torch.arange(length).repeat(prompts)
    seq = torch.arange(prompts).repeat_interleave(length)
    slots = tables[seq, positions // bs].long() * bs + positions % bs
    starts = torch.arange(prompts + 1, dtype=torch.int32) * length
    meta = AttentionMetadata(slots, tables, starts, torch.full((prompts,), length, dtype=torch.int32))
    ids = torch.randint(0, vocab, (prompts * length,), generator=torch.Generator().manual_seed(0))
    return ForwardInputs(ids, positions, meta, starts[1:].long() - 1).to(device)


def measure_model(sizes: Sizes, dtype, device, timer: Timer, copy_gbps: float, report) -> dict:
    arch, bs = sizes.arch, sizes.block_size
    prompts, length = sizes.prefill
    max_positions = max(length, sizes.decode_context + 1) + 1
    model = build_model(arch, dtype, device, max_positions)
    num_blocks = max(max(sizes.decode_batches) * (sizes.decode_context // bs + 1),
                     prompts * math.ceil(length / bs))
    storage = torch.zeros(arch.num_layers, 2, num_blocks, arch.num_kv_heads, bs, arch.head_dim,
                          dtype=dtype, device=device)
    runner = ModelRunner(model, [(layer[0], layer[1]) for layer in storage], bs, device, seed=0)
    embed = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    head_params = model.lm_head.weight.numel()
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    result = {"arch": asdict(arch), "dtype": str(dtype).replace("torch.", ""),
              "weight_bytes_read_per_decode_step": weight_bytes, "decode": [], "prefill": None}

    for batch in sizes.decode_batches:
        inputs = decode_inputs(batch, sizes.decode_context, bs, arch.vocab_size, device)
        step = timer.per_call(lambda _: runner.execute_model(inputs), sizes.iters // 2, warmup=3)
        result["decode"].append({"batch": batch, "context": sizes.decode_context,
                                 "eager_step_seconds": step, "eager_tokens_per_s": batch / step})
        report(result)

    inputs = prefill_inputs(prompts, length, bs, arch.vocab_size, device)
    step = timer.per_call(lambda _: runner.execute_model(inputs), max(2, sizes.iters // 5), warmup=1)
    tokens = prompts * length
    result["prefill"] = {"prompts": prompts, "tokens_each": length, "step_seconds": step,
                         "tokens_per_s": tokens / step,
                         # every row goes through the layers' linears; only `prompts` rows through the LM head
                         "linear_tflops": 2 * (layer_params * tokens + head_params * prompts) / step / 1e12}
    del inputs
    report(result)

    roof_seconds = weight_bytes / (copy_gbps * 1e9)
    result["roofline_batch1"] = {"seconds": roof_seconds, "tokens_per_s": 1 / roof_seconds,
                                 "note": "weight bytes / the copy's read+write GB/s"}
    # graphs last, through the serving path (the extension's CudaGraphs behind DecodeGraphs,
    # host inputs copied into its static buffers): a capture that fails leaves the rest measured
    try:
        width = sizes.decode_context // bs + 1
        backend = None if device.type == "cuda" else EagerReplay()  # the dry run's stand-in
        start = time.perf_counter()
        runner.graphs = capture_decode_graphs(model, runner.kv_caches, sizes.decode_batches, width,
                                              device, backend)
        result["graph_capture_seconds"] = time.perf_counter() - start
    except Exception as exc:  # report, do not hide, why the graphs failed
        result["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for entry in result["decode"]:
        graph = None
        if runner.graphs is not None:
            host = decode_inputs(entry["batch"], sizes.decode_context, bs, arch.vocab_size, torch.device("cpu"))
            graph = timer.per_call(lambda _: runner.execute_model(host), sizes.iters // 2, warmup=3)
        entry["graph_step_seconds"] = graph
        entry["graph_tokens_per_s"] = entry["batch"] / graph if graph else None
        report(result)
    batch1 = result["decode"][0]
    best = min(s for s in (batch1["eager_step_seconds"], batch1.get("graph_step_seconds")) if s)
    result["roofline_batch1"]["fraction_achieved"] = roof_seconds / best
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes: checks the script, in seconds")
    p.add_argument("--output-json", default="benchmarks/results/gpu_kernels.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and not args.dry_run:
        p.error("the full sizes need a GPU; use --dry-run on the CPU")
    sizes = DRY if args.dry_run else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    out_path = Path(args.output_json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "dry_run": args.dry_run}

    def report():
        out_path.write_text(json.dumps(results, indent=2))

    results["copy"] = measure_copy(sizes, device, timer)
    copy_gbps = results["copy"]["gbps_read_plus_write"]
    print(f"copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    report()
    results["attention_decode"] = measure_attention(sizes, dtype, device, timer, copy_gbps)
    for c in results["attention_decode"]["cases"]:
        graph = f"{c['graph_seconds'] * 1e6:.1f} us graph" if c["graph_seconds"] else "no graph"
        print(f"attention batch {c['batch']:>3} ctx {c['context']}: {c['eager_seconds'] * 1e6:.1f} us eager, "
              f"{graph}, {c['gbps']:.0f} GB/s = {c['fraction_of_copy']:.0%} of copy", flush=True)
    report()
    results["model"] = {}

    def report_model(model_result):
        results["model"] = model_result
        report()

    model = measure_model(sizes, dtype, device, timer, copy_gbps, report_model)
    report_model(model)
    for d in model["decode"]:
        graph_s = d.get("graph_step_seconds")
        best = min(graph_s or math.inf, d["eager_step_seconds"])
        graph = f", graph {graph_s * 1e3:.2f} ms" if graph_s else ""
        error = f"  [{model['graph_error']}]" if "graph_error" in model else ""
        print(f"decode batch {d['batch']:>3} ctx {d['context']}: eager {d['eager_step_seconds'] * 1e3:.2f} ms"
              f"{graph}, {d['batch'] / best:.0f} tok/s{error}", flush=True)
    pf, roof = model["prefill"], model["roofline_batch1"]
    print(f"prefill {pf['prompts']}x{pf['tokens_each']}: {pf['step_seconds'] * 1e3:.1f} ms, "
          f"{pf['tokens_per_s']:.0f} tok/s, {pf['linear_tflops']:.0f} TFLOP/s in the linears", flush=True)
    print(f"batch-1 roofline: {roof['seconds'] * 1e3:.2f} ms/step ({roof['tokens_per_s']:.0f} tok/s); "
          f"achieved {roof['fraction_achieved']:.0%}", flush=True)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
