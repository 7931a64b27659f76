"""A grammar compiler in a process of its own, so that a compile nobody waits for any more
can be stopped: xgrammar gives no way to interrupt a compile, and a thread cannot be killed,
but a process can (vLLM compiles regexes in killable processes for the same reason).

The two ends speak in frames over the child's stdin and stdout (an 8-byte big-endian length,
then the bytes). The parent sends the vocabulary (xgrammar's TokenizerInfo as JSON) once,
then one spec a frame (StructuredOutputsParams' fields as JSON); the child answers each with
"o" and the CompiledGrammar as JSON, or "e" and the reason it cannot compile. The child
compiles on one thread, so a big grammar costs at most one core.

Run as `python -m pyserve.structured.compile_process` (the parent does)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import struct
import sys
from collections.abc import Callable

from pyserve.sampling_params import StructuredOutputsParams
from pyserve.structured.compiler import GrammarError, compile_spec

_LENGTH = struct.Struct(">Q")
START_TIMEOUT_S = 120  # Python, torch (xgrammar imports it) and the vocabulary, on a busy machine


class CompileProcess:
    """The parent's end: one compile at a time (the caller serializes them). The process
    starts on the first compile (or ready()); a compile cancelled while the process works on
    it kills the process (its state is unknown then), and the next compile starts another.
    Not at once: a start (Python, xgrammar, torch, the vocabulary) costs seconds of a core,
    which only a grammar that needs the process should spend."""

    def __init__(self, tokenizer_info_json: Callable[[], str]):
        self._tokenizer_info_json = tokenizer_info_json  # called on the loop's executor
        self._start: asyncio.Task | None = None  # -> the ready process
        self._closed = False

    async def ready(self) -> asyncio.subprocess.Process:
        """The process, started if it is not (a GrammarError if it cannot be)."""
        if self._closed:
            raise GrammarError("structured_outputs", "the server is shutting down")
        failed = self._start is not None and self._start.done() and (
            self._start.cancelled() or self._start.exception() is not None)
        if self._start is None or failed:
            self._start = asyncio.get_running_loop().create_task(self._started())
        return await asyncio.shield(self._start)  # a cancelled wait leaves the start going on

    async def compile(self, spec: StructuredOutputsParams) -> str:
        """The serialized CompiledGrammar for spec (GrammarError if it cannot be compiled)."""
        proc = await self.ready()
        try:
            await _send(proc, json.dumps(dataclasses.asdict(spec)).encode())
            reply = await _receive(proc)
        except BaseException:
            self.kill()  # the next big grammar starts another
            raise
        if reply[:1] == b"o":
            return reply[1:].decode()
        raise GrammarError("structured_outputs", reply[1:].decode())

    async def _started(self) -> asyncio.subprocess.Process:
        info = await asyncio.get_running_loop().run_in_executor(None, self._tokenizer_info_json)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pyserve.structured.compile_process", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        try:
            await _send(proc, info.encode())
            await asyncio.wait_for(_receive(proc), START_TIMEOUT_S)  # "r": ready
        except asyncio.TimeoutError:
            proc.kill()
            raise GrammarError("structured_outputs", "the grammar compiler process did not start "
                               f"within {START_TIMEOUT_S} s") from None
        except BaseException:
            proc.kill()
            raise
        return proc

    def close(self) -> None:
        """Kills the process for good (the server is stopping)."""
        self._closed = True
        self.kill()

    def kill(self) -> None:
        start, self._start = self._start, None
        if start is None:
            return
        if not start.done():
            start.cancel()  # its process, if made, is killed as the start unwinds
        elif not start.cancelled() and start.exception() is None and start.result().returncode is None:
            start.result().kill()  # the event loop's child watcher reaps it


async def _send(proc, data: bytes) -> None:
    proc.stdin.write(_LENGTH.pack(len(data)) + data)
    await proc.stdin.drain()


async def _receive(proc) -> bytes:
    try:
        (length,) = _LENGTH.unpack(await proc.stdout.readexactly(_LENGTH.size))
        return await proc.stdout.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        raise GrammarError("structured_outputs", "the grammar compiler process stopped (out of "
                           "memory?); simplify the grammar") from None


def _read(stream) -> bytes | None:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    return stream.read(length)


def _write(stream, data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def main() -> None:
    import xgrammar as xgr

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the frames
    info = xgr.TokenizerInfo.deserialize_json(_read(stdin).decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write(stdout, b"r")
    while (frame := _read(stdin)) is not None:  # None: the parent closed the pipe
        try:
            reply = b"o" + compile_spec(compiler, StructuredOutputsParams(**json.loads(frame))) \
                .serialize_json().encode()
        except GrammarError as exc:
            reply = b"e" + exc.message.encode()
        _write(stdout, reply)


if __name__ == "__main__":
    main()
