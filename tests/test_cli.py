"""Flags -> Config: names and meanings of `vllm serve`, PYSERVE_* defaults, exit 2 on bad values."""

import subprocess
import sys

import pytest

from pyserve.cli import build_parser, parse_config
from pyserve.config import Config, parse_size


def test_defaults_and_sections():
    config = parse_config([], environ={})
    assert isinstance(config, Config)
    assert config.model.model is None and config.model.dtype == "auto"
    assert config.cache.block_size == 16 and config.cache.enable_prefix_caching
    assert config.scheduler.max_num_batched_tokens is None and config.scheduler.max_num_seqs is None
    assert config.parallel.tensor_parallel_size == 1
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8000)  # every interface, as vLLM


def test_flags_reach_their_sections(tmp_path):
    config = parse_config([
        "--model", str(tmp_path), "--dtype", "bfloat16", "--max-model-len", "1024",
        "--block-size", "32", "--kv-cache-memory", "2GiB", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--device", "cpu",
        "-tp", "2", "--port", "9001", "--api-key", "k", "--served-model-name", "m",
        "--load-format", "dummy", "--seed", "7", "--scheduling-policy", "priority",
        "--gguf-activations", "int8"], environ={})
    assert config.model.model == str(tmp_path) and config.model.dtype == "bfloat16"
    assert config.model.max_model_len == 1024 and config.model.seed == 7
    assert config.model.gguf_activations == "int8"
    assert config.cache.block_size == 32 and config.cache.kv_cache_memory == 2 * 1024**3
    assert not config.cache.enable_prefix_caching
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.scheduling_policy == "priority"
    assert config.parallel.tensor_parallel_size == 2 and config.server.port == 9001


def test_environment_gives_defaults_and_the_command_line_wins():
    env = {"PYSERVE_MAX_NUM_SEQS": "12", "PYSERVE_ENABLE_PREFIX_CACHING": "0",
           "PYSERVE_DOWNLOAD_DIR": "/tmp/models", "PYSERVE_KV_CACHE_MEMORY": "1GiB"}
    config = parse_config([], environ=env)
    assert config.scheduler.max_num_seqs == 12 and not config.cache.enable_prefix_caching
    assert config.model.download_dir == "/tmp/models" and config.cache.kv_cache_memory == 1024**3
    assert parse_config(["--max-num-seqs", "3"], environ=env).scheduler.max_num_seqs == 3


@pytest.mark.parametrize("argv,env,flag", [
    (["--block-size", "7"], {}, "--block-size"),
    (["--max-num-seqs", "0"], {}, "--max-num-seqs"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], {}, "--max-num-batched-tokens"),
    (["--kv-cache-memory", "lots"], {}, "--kv-cache-memory"),
    (["--dtype", "float8"], {}, "--dtype"),
    (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization"),
    (["--port", "70000"], {}, "--port"),
    (["--model", "/does/not/exist"], {}, "--model"),
    ([], {"PYSERVE_MAX_NUM_SEQS": "many"}, "--max-num-seqs"),
    (["--cuda-graph-sizes", "8", "0"], {}, "--cuda-graph-sizes"),
    (["--gguf-activations", "int4"], {}, "--gguf-activations"),
])
def test_bad_values_exit_2_naming_the_flag(argv, env, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv, environ=env)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cuda_graph_sizes_as_vllm_takes_them():
    assert parse_config([]).device.cuda_graph_sizes is None
    assert parse_config(["--cuda-graph-sizes", "8", "16"]).device.cuda_graph_sizes == (8, 16)
    assert parse_config([], environ={"PYSERVE_CUDA_GRAPH_SIZES": "32"}).device.cuda_graph_sizes == (32,)
    assert Config.from_flat(cuda_graph_sizes=[1, 2]).device.cuda_graph_sizes == (1, 2)


def test_bad_flag_fails_before_loading_anything():
    result = subprocess.run([sys.executable, "-m", "pyserve", "--max-model-len", "-5"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "--max-model-len" in result.stderr and "Traceback" not in result.stderr


def test_help_is_grouped():
    text = build_parser().format_help()
    for group in ("model:", "KV cache:", "scheduler:", "parallelism and device:", "server:"):
        assert group in text


def test_parse_size():
    assert parse_size("4GiB") == 4 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("2G") == 2 * 10**9
    assert parse_size("1000") == 1000
    for bad in ("", "GiB", "-1", "4XB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_config_from_flat_rejects_unknown_options():
    with pytest.raises(TypeError, match="unknown configuration option"):
        Config.from_flat(max_num_sequences=3)
