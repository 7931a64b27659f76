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
    for group in ("model:", "KV cache:", "scheduler:", "parallelism and device:", "server:",
                  "logging:", "vLLM flags pyserve has no use for:"):
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


# -- vLLM's command line: `serve MODEL`, its environment variables, the console script ------------

GiB = 1024**3


def test_serve_takes_the_model_as_its_positional_argument(tmp_path):
    from pyserve.cli import parse_serve

    assert parse_serve([str(tmp_path), "--max-num-seqs", "4"], environ={}).config.model.model == str(tmp_path)
    both = parse_serve([str(tmp_path), "--model", str(tmp_path)], environ={})
    assert both.config.model.model == str(tmp_path)
    # a PYSERVE_MODEL default gives way to the positional model, as a flag default would
    env = {"PYSERVE_MODEL": "/elsewhere"}
    assert parse_serve([str(tmp_path)], environ=env).config.model.model == str(tmp_path)


def test_two_different_models_exit_2(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SystemExit) as exc:
        parse_config([str(tmp_path), "--model", str(other)], environ={})
    assert exc.value.code == 2 and "the model is given twice" in capsys.readouterr().err


def test_vllm_api_key_variable_and_the_flag_wins():
    assert parse_config([], environ={"VLLM_API_KEY": "env-key"}).server.api_key == ("env-key",)
    assert parse_config(["--api-key", "a", "b"], environ={"VLLM_API_KEY": "env-key"}).server.api_key == ("a", "b")
    env = {"VLLM_API_KEY": "vllm-key", "PYSERVE_API_KEY": "pyserve-key"}
    assert parse_config([], environ=env).server.api_key == ("pyserve-key",)
    assert parse_config([], environ={}).server.api_key == ()


def test_vllm_logging_level_variable_and_the_flag_wins(capsys):
    from pyserve.cli import parse_serve

    assert parse_serve([], environ={}).log_level == "info"
    assert parse_serve([], environ={"VLLM_LOGGING_LEVEL": "DEBUG"}).log_level == "debug"
    assert parse_serve(["--log-level", "error"], environ={"VLLM_LOGGING_LEVEL": "DEBUG"}).log_level == "error"
    # uvicorn's own level (vLLM's HTTP server): pyserve's level stays
    assert parse_serve(["--uvicorn-log-level", "warning"], environ={}).log_level == "info"
    assert parse_serve([], environ={"VLLM_LOGGING_LEVEL": "WARN"}).log_level == "warn"
    with pytest.raises(SystemExit) as exc:
        parse_serve([], environ={"VLLM_LOGGING_LEVEL": "LOUD"})
    assert exc.value.code == 2 and "VLLM_LOGGING_LEVEL" in capsys.readouterr().err


def test_vllm_cpu_kvcache_space_sizes_the_cpu_cache_unless_a_flag_does(capsys):
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert parse_config(["--device", "cpu"], environ=env).cache.kv_cache_memory == 2 * GiB
    assert parse_config(["--device", "cpu", "--kv-cache-memory", "1GiB"], environ=env).cache.kv_cache_memory == GiB
    assert parse_config(["--device", "cpu", "--kv-cache-memory-bytes", "3G"], environ=env).cache.kv_cache_memory == 3 * GiB
    env_both = {**env, "PYSERVE_KV_CACHE_MEMORY": "512MiB"}
    assert parse_config(["--device", "cpu"], environ=env_both).cache.kv_cache_memory == 512 * 1024**2
    assert parse_config(["--device", "cuda"], environ=env).cache.kv_cache_memory is None  # CPU only
    assert parse_config(["--device", "cpu"], environ={"VLLM_CPU_KVCACHE_SPACE": "0"}).cache.kv_cache_memory is None
    with pytest.raises(SystemExit) as exc:
        parse_config(["--device", "cpu"], environ={"VLLM_CPU_KVCACHE_SPACE": "1.5"})
    assert exc.value.code == 2 and "VLLM_CPU_KVCACHE_SPACE" in capsys.readouterr().err


def test_kv_cache_memory_bytes_takes_vllm_suffixes(capsys):
    assert parse_config(["--kv-cache-memory-bytes", "8g"], environ={}).cache.kv_cache_memory == 8 * 10**9
    assert parse_config(["--kv-cache-memory-bytes", "1048576"], environ={}).cache.kv_cache_memory == 2**20
    with pytest.raises(SystemExit):
        parse_config(["--kv-cache-memory-bytes", "1.5G"], environ={})
    assert "--kv-cache-memory-bytes" in capsys.readouterr().err


def test_max_model_len_auto_is_the_models():
    assert parse_config(["--max-model-len", "auto"], environ={}).model.max_model_len is None
    assert parse_config(["--max-model-len", "-1"], environ={}).model.max_model_len is None
    assert parse_config(["--max-model-len", "1K"], environ={}).model.max_model_len == 1024


@pytest.mark.parametrize("value", ["{bad", "[1, 2]", "0.5"])
def test_override_generation_config_must_be_a_json_object(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--override-generation-config", value], environ={})
    assert exc.value.code == 2 and "--override-generation-config" in capsys.readouterr().err


def test_disable_log_stats_and_log_requests():
    assert parse_config(["--disable-log-stats"], environ={}).scheduler.log_stats_interval == 0
    config = parse_config(["--disable-log-requests"], environ={})
    assert not config.server.enable_log_requests
    assert parse_config(["--enable-log-requests"], environ={}).server.enable_log_requests


def test_main_sets_the_log_level_and_logs_each_warning_once(monkeypatch, caplog):
    import logging

    import uvloop

    import pyserve.server.app as app
    from pyserve import cli

    served = []

    async def fake_serve(config):
        served.append(config)
        return 0

    monkeypatch.setattr(app, "serve", fake_serve)
    monkeypatch.setattr(uvloop, "run", lambda coro: __import__("asyncio").run(coro))
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)
    with caplog.at_level(logging.WARNING, logger="pyserve"):
        assert cli.main(["--log-level", "error", "--trust-remote-code", "--port", "9123"]) == 0
    assert served[0].server.port == 9123
    assert root.level == logging.ERROR
    lines = [r.getMessage() for r in caplog.records if "--trust-remote-code" in r.getMessage()]
    assert len(lines) == 1


def _run(*argv, **kwargs):
    return subprocess.run([sys.executable, "-m", "pyserve", *argv], capture_output=True,
                          text=True, timeout=60, **kwargs)


def test_commands_dispatch_without_loading_the_server():
    done = _run("serve", "/does/not/exist")
    assert done.returncode == 2 and "--model: '/does/not/exist' does not exist" in done.stderr
    done = _run("serve", "--foo")
    assert done.returncode == 2 and "pyserve does not support --foo" in done.stderr
    assert "python -m pyserve serve" in done.stderr and "Traceback" not in done.stderr
    done = _run("chat", "--bar")
    assert done.returncode == 2 and "pyserve does not support --bar" in done.stderr
    done = _run("--version")
    assert done.returncode == 0 and done.stdout.startswith("pyserve ")


def test_chat_reports_an_unreachable_server_in_one_line():
    from tests.e2e.server import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    done = _run("chat", "--url", url, "--quick", "hi")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert url in done.stderr and "cannot reach the server" in done.stderr


def test_console_script_is_installed():
    import shutil
    from pathlib import Path

    script = Path(sys.executable).parent / "pyserve"
    if not script.exists():
        pytest.skip("the pyserve console script is not installed (pip install -e . makes it)")
    done = subprocess.run([str(script), "serve", "--data-parallel-size", "2"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "pyserve serve: error: pyserve does not support --data-parallel-size 2" in done.stderr
    done = subprocess.run([str(script), "chat", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--quick" in done.stdout and "--system-prompt" in done.stdout
    assert shutil.which("pyserve", path=str(script.parent)) == str(script)


def test_a_chat_template_that_looks_like_a_path_but_is_no_file_exits_2(tmp_path, capsys):
    """vLLM refuses such a value at start-up; it is not served as a template whose text is the
    path. A file is read later, and inline Jinja (braces, new lines) is taken as it is."""
    with pytest.raises(SystemExit) as exc:
        parse_config(["--chat-template", "../../examples/does_not_exist"], environ={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "looks like a file path" in err
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    for value in (str(template), "{{ messages }}", "plain text\nwith a new line"):
        assert parse_config(["--chat-template", value], environ={}).server.chat_template == value
