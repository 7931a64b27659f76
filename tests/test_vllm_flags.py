"""Every vLLM flag pyserve knows (pyserve/vllm_flags.py) does what its table says: honoured (the
value reaches its Config field, no warning), warned (one warning line naming it, parse
succeeds) or refused (exit 2, a sentence naming it); an unknown flag exits 2 saying so."""

import operator

import pytest

from pyserve.config import SpeculativeConfig
from pyserve.pooling_params import PoolerConfig

from pyserve.cli import parse_serve
from pyserve.vllm_flags import FOREIGN, HONOURED, foreign_names

GiB = 1024**3

# vLLM flag -> (argv, expected value at HONOURED[flag]); {dir} is an existing directory
HONOURED_EXAMPLES = {
    "--model": (["--model", "{dir}"], "{dir}"),
    "--tokenizer": (["--tokenizer", "{dir}"], "{dir}"),
    "--served-model-name": (["--served-model-name", "a", "b"], ("a", "b")),
    "--dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "--max-model-len": (["--max-model-len", "4k"], 4000),
    "--seed": (["--seed", "7"], 7),
    "--load-format": (["--load-format", "safetensors"], "safetensors"),
    "--generation-config": (["--generation-config", "vllm"], "vllm"),
    "--override-generation-config": (["--override-generation-config",
                                      '{"top_p": 0.9, "temperature": 0.5}'],
                                     (("temperature", 0.5), ("top_p", 0.9))),
    "--max-logprobs": (["--max-logprobs", "-1"], -1),
    "--speculative-config": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                             SpeculativeConfig("ngram", 3, 5, 5, 4)),
    "--pooler-config": (["--pooler-config", '{"pooling_type": "MEAN", "normalize": false}'],
                        PoolerConfig("MEAN", False)),
    "--download-dir": (["--download-dir", "{dir}"], "{dir}"),
    "--block-size": (["--block-size", "32"], 32),
    "--gpu-memory-utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "--kv-cache-memory-bytes": (["--kv-cache-memory-bytes", "2G"], 2 * GiB),
    "--enable-prefix-caching": (["--no-enable-prefix-caching"], False),
    "--disable-hybrid-kv-cache-manager": (["--disable-hybrid-kv-cache-manager"], True),
    "--kv-cache-dtype": (["--kv-cache-dtype", "bfloat16"], "bfloat16"),
    "--max-num-seqs": (["--max-num-seqs", "8"], 8),
    "--max-num-batched-tokens": (["--max-num-batched-tokens", "2K"], 2048),
    "--scheduling-policy": (["--scheduling-policy", "priority"], "priority"),
    "--disable-log-stats": (["--disable-log-stats"], 0.0),
    "--tensor-parallel-size": (["-tp", "2"], 2),
    "--pipeline-parallel-size": (["-pp", "2"], 2),
    "--distributed-executor-backend": (["--distributed-executor-backend", "mp"], "mp"),
    "--device": (["--device", "cpu"], "cpu"),
    "--enforce-eager": (["--enforce-eager"], True),
    "--cuda-graph-sizes": (["--cuda-graph-sizes", "8", "16"], (8, 16)),
    "--host": (["--host", "127.0.0.1"], "127.0.0.1"),
    "--port": (["--port", "9000"], 9000),
    "--api-key": (["--api-key", "k1", "k2"], ("k1", "k2")),
    "--allowed-origins": (["--allowed-origins", '["https://a.example"]'], ("https://a.example",)),
    "--allowed-methods": (["--allowed-methods", "GET,POST"], ("GET", "POST")),
    "--allowed-headers": (["--allowed-headers", "x-a"], ("x-a",)),
    "--allow-credentials": (["--allow-credentials", "--allowed-origins", "https://a.example"], True),
    "--chat-template": (["--chat-template", "{{ messages }}"], "{{ messages }}"),
    "--default-chat-template-kwargs": (["--default-chat-template-kwargs", '{"enable_thinking": false}'],
                                       (("enable_thinking", False),)),
    "--enable-log-requests": (["--enable-log-requests"], True),
    "--disable-log-requests": (["--disable-log-requests"], None),
    "--max-log-len": (["--max-log-len", "100"], 100),
    "--enable-request-id-headers": (["--enable-request-id-headers"], True),
    "--trust-request-chat-template": (["--trust-request-chat-template"], True),
    "--response-role": (["--response-role", "helper"], "helper"),
    "--enable-prompt-tokens-details": (["--enable-prompt-tokens-details"], True),
    "--enable-force-include-usage": (["--enable-force-include-usage"], True),
    "--root-path": (["--root-path", "api/"], "/api"),
    "--return-tokens-as-token-ids": (["--return-tokens-as-token-ids"], True),
    "--enable-server-load-tracking": (["--enable-server-load-tracking"], True),
    "--enable-tokenizer-info-endpoint": (["--enable-tokenizer-info-endpoint"], True),
    "--enable-auto-tool-choice": (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], True),
    "--tool-call-parser": (["--tool-call-parser", "llama3_json"], "llama3_json"),
    "--reasoning-parser": (["--reasoning-parser", "deepseek_r1"], "deepseek_r1"),
    "--log-level": (["--log-level", "DEBUG"], "debug"),
}

# (argv, outcome) for every FOREIGN flag under every spelling
FOREIGN_EXAMPLES = [
    (["--enable-chunked-prefill"], "honoured"),
    (["--no-enable-chunked-prefill"], "warned"),
    (["--disable-sliding-window"], "warned"),
    (["--disable-frontend-multiprocessing"], "honoured"),
    (["--preemption-mode", "recompute"], "honoured"),
    (["--preemption-mode", "swap"], "refused"),
    (["--task", "generate"], "honoured"),
    (["--task", "embed"], "honoured"),
    (["--task", "classify"], "refused"),
    (["--runner", "auto"], "honoured"),
    (["--runner", "pooling"], "honoured"),
    (["--runner", "draft"], "refused"),
    (["--convert", "embed"], "honoured"),
    (["--convert", "classify"], "refused"),
    (["--tokenizer-mode", "auto"], "honoured"),
    (["--tokenizer-mode", "mistral"], "refused"),
    (["--quantization", "gguf"], "honoured"),
    (["-q", "awq"], "refused"),
    (["--data-parallel-size", "1"], "honoured"),
    (["-dp", "2"], "refused"),
    (["--api-server-count", "1"], "honoured"),
    (["--api-server-count", "4"], "refused"),
    (["--cpu-offload-gb", "0"], "honoured"),
    (["--cpu-offload-gb", "4"], "refused"),
    (["--trust-remote-code"], "warned"),
    (["--revision", "main"], "warned"),
    (["--code-revision", "main"], "warned"),
    (["--tokenizer-revision", "main"], "warned"),
    (["--hf-token", "hf_x"], "warned"),
    (["--swap-space", "4"], "warned"),
    (["--disable-custom-all-reduce"], "warned"),
    (["--max-seq-len-to-capture", "8192"], "warned"),
    (["--compilation-config", '{"level": 3}'], "warned"),
    (["-O3"], "warned"),
    (["--enable-expert-parallel"], "warned"),
    (["-ep"], "warned"),
    (["--max-parallel-loading-workers", "2"], "warned"),
    (["--disable-fastapi-docs"], "warned"),
    (["--disable-uvicorn-access-log"], "warned"),
    (["--uvicorn-log-level", "warning"], "honoured"),  # uvicorn's level: no uvicorn, no change
    (["--enable-log-outputs"], "warned"),
    (["--otlp-traces-endpoint", "http://collector:4317"], "warned"),
    (["--ssl-keyfile", "key.pem"], "refused"),
    (["--ssl-certfile", "cert.pem"], "refused"),
    (["--ssl-ca-certs", "ca.pem"], "refused"),
    (["--enable-lora"], "refused"),
    (["--lora-modules", "a=/x", "b=/y"], "refused"),
    (["--max-loras", "2"], "refused"),
    (["--max-lora-rank", "16"], "refused"),
    (["--limit-mm-per-prompt", '{"image": 2}'], "refused"),
    (["--mm-processor-kwargs", "{}"], "refused"),
    (["--hf-overrides", "{}"], "refused"),
    (["--enable-sleep-mode"], "refused"),
    (["--middleware", "x.y"], "refused"),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], "honoured"),
    (["--structured-outputs-config", '{"backend": "auto", "disable_fallback": true}'], "honoured"),
    (["--structured-outputs-config", '{"backend": "outlines"}'], "refused"),
    (["--structured-outputs-config", '{"disable_any_whitespace": true}'], "refused"),
    (["--max-cudagraph-capture-size", "256"], "warned"),
    (["--prefix-caching-hash-algo", "sha256"], "warned"),
    (["--long-prefill-token-threshold", "512"], "warned"),
    (["--max-num-partial-prefills", "2"], "warned"),
    (["--max-long-partial-prefills", "1"], "warned"),
    (["--log-config-file", "logging.json"], "warned"),
    (["--guided-decoding-backend", "xgrammar"], "honoured"),
    (["--guided-decoding-backend", "outlines"], "refused"),
    (["--chat-template-content-format", "string"], "honoured"),
    (["--chat-template-content-format", "openai"], "refused"),
    (["--uds", "/tmp/vllm.sock"], "refused"),
    (["--tool-parser-plugin", "my_parser.py"], "refused"),
    (["--limit-mm-per-prompt", '{"image": 0, "video": 0}'], "honoured"),  # text only
    (["--language-model-only"], "honoured"),
    (["--performance-mode", "throughput"], "warned"),
    (["--optimization-level", "3"], "warned"),
    (["--stream-interval", "1"], "honoured"),
    (["--stream-interval", "8"], "warned"),
    (["--attention-backend", "FLASH_ATTN"], "warned"),
    (["--model-impl", "auto"], "honoured"),
    (["--model-impl", "transformers"], "refused"),
]


def _long_name(argv: list[str]) -> str:
    """The spelling messages use: the long name, or --no-X as given."""
    for flag in FOREIGN:
        if argv[0] == "--no-" + flag.names[0][2:]:
            return argv[0]
        if argv[0] in flag.names or (argv[0].startswith("-O") and "-O" in flag.names):
            return flag.names[0]
    raise AssertionError(argv)


def test_every_listed_flag_has_an_example():
    assert set(HONOURED_EXAMPLES) == set(HONOURED)
    spelled = {argv[0] for argv, _ in FOREIGN_EXAMPLES} | {"-O"}
    assert set(foreign_names()) <= spelled
    assert not set(HONOURED) & set(foreign_names())


@pytest.mark.parametrize("flag", sorted(HONOURED_EXAMPLES))
def test_honoured_flags_reach_their_field(flag, tmp_path):
    argv, expected = HONOURED_EXAMPLES[flag]
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    if isinstance(expected, str):
        expected = expected.replace("{dir}", str(tmp_path))
    args = parse_serve(argv, environ={})
    assert args.warnings == ()
    path = HONOURED[flag]
    if path is not None:
        assert operator.attrgetter(path)(args) == expected


@pytest.mark.parametrize("argv,outcome", FOREIGN_EXAMPLES, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else v)
def test_foreign_flags_are_accepted_warned_or_refused(argv, outcome, capsys):
    name = _long_name(argv)
    if outcome == "refused":
        with pytest.raises(SystemExit) as exc:
            parse_serve(argv, environ={})
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"pyserve does not support {name}" in err and ": it " in err.split(name, 1)[1]
        return
    args = parse_serve(argv, environ={})
    if outcome == "honoured":
        assert args.warnings == ()
    else:
        assert len(args.warnings) == 1 and name in args.warnings[0]
        assert "ignored: pyserve" in args.warnings[0]


def test_foreign_flags_from_pyserve_variables_are_judged_the_same(capsys):
    args = parse_serve([], environ={"PYSERVE_TRUST_REMOTE_CODE": "1", "PYSERVE_CPU_OFFLOAD_GB": "0"})
    assert len(args.warnings) == 1 and "--trust-remote-code" in args.warnings[0]
    with pytest.raises(SystemExit):
        parse_serve([], environ={"PYSERVE_DATA_PARALLEL_SIZE": "2"})
    assert "pyserve does not support --data-parallel-size 2: it " in capsys.readouterr().err


@pytest.mark.parametrize("argv,named", [
    (["--foo"], "--foo"), (["--foo=1"], "--foo"), (["--enable-foo-bar", "x"], "--enable-foo-bar"),
    (["-x"], "-x"),
])
def test_unknown_flags_exit_2_saying_pyserve_does_not_support_them(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_serve(argv, environ={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"pyserve does not support {named} " in err and "unrecognized" not in err


def test_an_extra_positional_is_named(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse_serve([str(tmp_path), "extra"], environ={})
    assert "unexpected argument 'extra'" in capsys.readouterr().err


def test_every_switch_takes_its_no_form():
    """vLLM's boolean flags take --no-X too: the switch stays off (a foreign one asks for nothing)."""
    args = parse_serve(["--enforce-eager", "--no-enforce-eager", "--no-trust-remote-code",
                        "--no-enable-log-requests", "--no-async-scheduling", "--no-enable-prefix-caching"],
                       environ={})
    assert args.config.device.enforce_eager is False and args.warnings == ()
    assert args.config.cache.enable_prefix_caching is False
    assert args.config.scheduler.async_scheduling is False


def test_a_config_file_gives_flags_the_command_line_overrides(tmp_path):
    (tmp_path / "serve.yaml").write_text("max_model_len: 1024\nenforce_eager: true\nserved_model_name: [a, b]\n"
                                         "override_generation_config: {temperature: 0.5}\nport: 8123\n"
                                         "enable_prefix_caching: false\n")
    model = str(tmp_path / "model")
    (tmp_path / "model").mkdir()
    args = parse_serve([model, "--config", str(tmp_path / "serve.yaml"), "--port", "9000"], environ={})
    assert args.config.model.model == model  # a list in the file does not take it
    c = args.config
    assert (c.model.max_model_len, c.device.enforce_eager, c.model.served_model_name) == (1024, True, ("a", "b"))
    assert c.model.override_generation_config == (("temperature", 0.5),) and c.server.port == 9000
    assert c.cache.enable_prefix_caching is False
    with pytest.raises(SystemExit):
        parse_serve(["--config", str(tmp_path / "missing.yaml")], environ={})


def test_a_hugging_face_id_is_read_from_the_cache(tmp_path, tiny_model_factory, capsys):
    """`serve org/name`, as vLLM takes it: the Hugging Face cache's snapshot (HF_HOME), named as
    asked; with HF_HUB_OFFLINE a model not in the cache is a clear exit 2."""
    import shutil

    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model_factory("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    args = parse_serve(["tiny-org/tiny-llama", "--revision", "main"], environ=env)
    assert args.config.model.model == str(repo / "snapshots" / commit) and args.warnings == ()
    assert args.config.model.served_model_name == ("tiny-org/tiny-llama",)
    with pytest.raises(SystemExit) as exc:
        parse_serve(["tiny-org/missing"], environ=env)
    assert exc.value.code == 2 and "HF_HUB_OFFLINE" in capsys.readouterr().err
    # a tokenizer alone in the cache (what AutoTokenizer fetches) is no model
    partial = tmp_path / "hub" / "models--tiny-org--tokenizer-only"
    (partial / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(repo / "snapshots" / commit / "tokenizer.json", partial / "snapshots" / commit)
    (partial / "refs").mkdir()
    (partial / "refs" / "main").write_text(commit)
    with pytest.raises(SystemExit):
        parse_serve(["tiny-org/tokenizer-only"], environ=env)


def test_the_structured_outputs_configs_reasoning_parser(capsys):
    """vLLM keeps its reasoning parser in --structured-outputs-config (--reasoning-parser is an
    alias): it is read; grammars inside the reasoning are not pyserve's and are refused."""
    args = parse_serve(["--structured-outputs-config", '{"backend": "auto", "reasoning_parser": "qwen3"}'],
                       environ={})
    assert args.config.server.reasoning_parser == "qwen3" and args.warnings == ()
    with pytest.raises(SystemExit):
        parse_serve(["--structured-outputs-config", '{"reasoning_parser": "qwen3"}',
                     "--reasoning-parser", "deepseek_r1"], environ={})
    with pytest.raises(SystemExit):
        parse_serve(["--structured-outputs-config", '{"enable_in_reasoning": true}'], environ={})
    assert "pyserve does not support --structured-outputs-config" in capsys.readouterr().err


def test_vllm_allow_long_max_model_len():
    args = parse_serve(["--max-model-len", "100000"], environ={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert args.config.model.allow_long_max_model_len is True
    assert parse_serve([], environ={}).config.model.allow_long_max_model_len is False


def test_underscored_flags_as_vllm_takes_them():
    args = parse_serve(["--max_model_len=64", "--max_num_seqs", "4", "--trust_remote_code"],
                       environ={})
    assert args.config.model.max_model_len == 64 and args.config.scheduler.max_num_seqs == 4
    assert len(args.warnings) == 1


def test_help_shows_the_foreign_group():
    from pyserve.cli import build_parser

    text = build_parser().format_help()
    assert "vLLM flags pyserve has no use for:" in text and "--cpu-offload-gb" in text
