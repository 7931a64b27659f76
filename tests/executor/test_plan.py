"""Start-up resolution as a pure function of the configuration, tested without weights: a model
directory holding only config.json, a generation config and a tokenizer."""

import json
import shutil

import pytest
import torch

from pyserve.config import Config
from pyserve.errors import ModelLoadError
from pyserve.executor.plan import resolve


@pytest.fixture
def weightless_dir(tiny_model_factory, tmp_path):
    source = tiny_model_factory("llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return tmp_path


def plan(path, **flags):
    return resolve(Config.from_flat(model=str(path), load_format="dummy", device="cpu", **flags))


def test_the_plan_reads_config_only(weightless_dir):
    arch = json.loads((weightless_dir / "config.json").read_text())
    p = plan(weightless_dir, kv_cache_memory="1MiB")
    assert not any(weightless_dir.glob("*.safetensors"))
    assert p.device == "cpu" and p.max_model_len == arch["max_position_embeddings"]
    assert p.vocab_size == arch["vocab_size"]
    per_block = (2 * arch["num_hidden_layers"] * arch["num_key_value_heads"]
                 * (arch["hidden_size"] // arch["num_attention_heads"]) * 16 * 4)
    assert p.bytes_per_block == per_block and p.num_blocks == 2**20 // per_block
    assert p.block_order == "resident" and p.shard.cuda_graph_sizes == ()
    # the CPU's step limits, filled in
    assert (p.config.scheduler.max_num_seqs, p.config.scheduler.max_num_batched_tokens) == (128, 128)
    assert p.shard.dtype == torch.float32 and p.shard.num_blocks == p.num_blocks


def test_eos_ids_honour_the_generation_config(weightless_dir):
    assert plan(weightless_dir).eos_token_ids == (2, 7)  # config.json's and the generation config's
    assert plan(weightless_dir, generation_config="vllm").eos_token_ids == (2,)


def test_a_cache_too_small_for_one_sequence_is_refused(weightless_dir):
    with pytest.raises(ModelLoadError, match="cannot hold one sequence"):
        plan(weightless_dir, kv_cache_memory=1024)


def test_given_step_limits_and_block_order_are_kept(weightless_dir):
    p = plan(weightless_dir, max_num_batched_tokens=40, kv_block_order="lru", max_model_len=64)
    assert (p.config.scheduler.max_num_seqs, p.config.scheduler.max_num_batched_tokens) == (40, 40)
    assert p.block_order == "lru" and p.max_model_len == 64 and p.blocks_per_sequence == 4
