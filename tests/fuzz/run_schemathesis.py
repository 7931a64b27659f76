"""schemathesis against a real pyserve server: every operation of its /openapi.json, bodies
generated from the document's schemas (valid ones and, with --mode all, ones that break them),
checked for no 5xx, answers that conform to the document (status, content type, body) and,
after the run, the engine's books balanced (every accepted request ended, no KV block kept).

    python -m tests.fuzz.run_schemathesis --max-examples 200      # a longer run
    python -m tests.fuzz.run_schemathesis --model DIR --seed 7     # another model, another seed

The server serves a tiny random model (tools/make_tiny_model.py) with every optional route on
and an API key (schemathesis sends it); CI runs this with a small budget
(tests/fuzz/test_schemathesis.py). Exit status: schemathesis's (0: nothing found), or 1 when
the books do not balance."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.server import ServerProcess, assert_books_balanced

ROOT = Path(__file__).resolve().parents[2]
KEY = "schemathesis-key"
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance")
# Generated requests stay cheap: a model length of 64 bounds every generation (a longer prompt
# is a 400), and one that sets no max_tokens stops after 8 tokens, not at the model length.
SMALL_WORK = ("--max-model-len", "64", "--override-generation-config", '{"max_new_tokens": 8}')
# the readers are lax as vLLM's pydantic is ("3" for 3): a body that breaks a schema's type may
# still be read, so negative_data_rejection is not one of the checks


def tiny_model(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tools"))
    from make_tiny_model import make_tiny_model

    return make_tiny_model(out, "llama")


def schemathesis_command(url: str, args) -> list[str]:
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json",
               "--checks", ",".join(CHECKS), "--mode", args.mode,
               "--max-examples", str(args.max_examples), "--seed", str(args.seed),
               "--phases", args.phases, "--workers", "1", "--request-timeout", "60",
               "--generation-database", "none", "--no-color",
               "-H", f"Authorization: Bearer {KEY}", "--suppress-health-check", "all"]
    if args.max_time is not None:
        command += ["--max-time", str(args.max_time)]
    return command


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="pyserve-schemathesis-") as tmp:
        model = args.model or str(tiny_model(Path(tmp)))
        server = ServerProcess("--model", model, "--api-key", KEY, "--kv-cache-memory", "64MiB",
                               *SMALL_WORK, "--enable-debug-endpoints",
                               "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking")
        try:
            t0 = time.monotonic()
            rc = subprocess.run(schemathesis_command(server.url, args), cwd=tmp).returncode
            print(f"[run_schemathesis] schemathesis exited {rc} after {time.monotonic() - t0:.1f}s")
            if server.proc.poll() is not None:
                print("[run_schemathesis] the server died during the run")
                return 1
            try:
                assert_books_balanced(server.url, KEY, wait_s=30.0)
            except AssertionError as exc:
                print(f"[run_schemathesis] {exc}")
                return 1
            return rc
        finally:
            server.stop()
            log = server.output()
            errors = [line for line in log.splitlines() if "Traceback" in line or "ERROR" in line]
            if errors:  # a handler's exception is answered 500; show the server's side of it
                print("[run_schemathesis] server log errors:\n" + log[-20000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=200, help="test cases per operation")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=("positive", "negative", "all"), default="all")
    parser.add_argument("--phases", default="examples,coverage,fuzzing")
    parser.add_argument("--max-time", type=int, default=None, help="seconds for the whole run")
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny random one)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
