"""Runs the CUDA tests without pytest, for a machine that lacks it.

    python tools/run_cuda_tests.py [--stub] [-k SUBSTRING] [TEST_FILE ...]

By default: tests/cuda/test_*.py and tests/kernels/test_cuda.py. Each module is imported and
each test_* function called; module and function marks are honoured as pytest would: skipif
(a true condition skips), skip, and parametrize (the cartesian product of the parameter
lists). Tests that need pytest fixtures are reported as skipped. Where pytest is missing (or
with --stub) a minimal stand-in module named pytest is installed first, with mark, skip and
raises, which is all these tests use. Exit status 1 if any test failed, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import itertools
import re
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = sorted((ROOT / "tests/cuda").glob("test_*.py")) + [ROOT / "tests/kernels/test_cuda.py"]


class Mark:
    def __init__(self, name, args, kwargs):
        self.name, self.args, self.kwargs = name, args, kwargs


class MarkDecorator(Mark):
    """pytest.mark.NAME(...): applied to a function, appends itself to func.pytestmark."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and inspect.isfunction(args[0]):
            func = args[0]
            func.pytestmark = [*getattr(func, "pytestmark", []), Mark(self.name, self.args, self.kwargs)]
            return func
        return MarkDecorator(self.name, args, kwargs)


class Skipped(Exception):
    pass


def install_pytest_stub() -> None:
    stub = types.ModuleType("pytest")
    stub.__doc__ = "tools/run_cuda_tests.py's stand-in for pytest"

    class MarkGenerator:
        def __getattr__(self, name):
            return MarkDecorator(name, (), {})

    def skip(reason: str = ""):
        raise Skipped(reason)

    @contextlib.contextmanager
    def raises(expected, match: str | None = None):
        try:
            yield
        except expected as exc:
            if match is not None and not re.search(match, str(exc)):
                raise AssertionError(f"{type(exc).__name__} {str(exc)!r} does not match {match!r}") from exc
        else:
            raise AssertionError(f"did not raise {expected}")

    def importorskip(name: str, reason: str | None = None):
        try:
            return importlib.import_module(name)
        except ImportError:
            raise Skipped(reason or f"could not import {name!r}") from None

    stub.mark = MarkGenerator()
    stub.skip = skip
    stub.importorskip = importorskip
    skip.Exception = Skipped
    stub.raises = raises
    sys.modules["pytest"] = stub


def marks_of(obj) -> list:
    marks = getattr(obj, "pytestmark", [])
    return list(marks) if isinstance(marks, (list, tuple)) else [marks]


def skip_reason(marks) -> str | None:
    for mark in marks:
        if mark.name == "skip":
            return mark.kwargs.get("reason", mark.args[0] if mark.args else "skip")
        if mark.name == "skipif" and mark.args and not isinstance(mark.args[0], str) and mark.args[0]:
            return mark.kwargs.get("reason", "skipif")
    return None


def parameter_sets(marks) -> list[tuple[str, dict]]:
    """parametrize marks -> [(id, kwargs)], the cartesian product over marks."""
    axes = []
    for mark in marks:
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = [(v,) if len(names) == 1 else tuple(v) for v in values]
        axes.append([dict(zip(names, row)) for row in rows])
    sets = []
    for combo in itertools.product(*axes):
        kwargs = {k: v for part in combo for k, v in part.items()}
        sets.append(("-".join(str(v) for v in kwargs.values()), kwargs))
    return sets or [("", {})]


def run_module(path: Path, keyword: str | None, counts: dict) -> None:
    rel = path.resolve().relative_to(ROOT)
    name = ".".join(rel.with_suffix("").parts)
    try:
        module = importlib.import_module(name)
    except BaseException as exc:
        if isinstance(exc, Skipped) or type(exc).__name__ == "Skipped":  # a module-level skip
            counts["skipped"] += 1
            print(f"SKIPPED {rel}: {exc}", flush=True)
            return
        if not isinstance(exc, Exception):
            raise
        counts["failed"] += 1
        print(f"ERROR importing {rel}\n{traceback.format_exc()}", flush=True)
        return
    module_marks = marks_of(module)
    tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_")]
    for test_name, func in tests:
        if not inspect.isfunction(func):  # a decorator the stand-in got wrong: say so, do not drop it
            counts["failed"] += 1
            print(f"ERROR {rel}::{test_name} is a {type(func).__name__}, not a function", flush=True)
    tests = [(n, f) for n, f in tests if inspect.isfunction(f)]
    for test_name, func in sorted(tests, key=lambda t: t[1].__code__.co_firstlineno):
        marks = module_marks + marks_of(func)
        for param_id, kwargs in parameter_sets(marks):
            test_id = f"{rel}::{test_name}" + (f"[{param_id}]" if param_id else "")
            if keyword and keyword not in test_id:
                continue
            reason = skip_reason(marks)
            missing = [p for p in inspect.signature(func).parameters if p not in kwargs]
            if reason is None and missing:
                reason = f"needs pytest fixtures {missing}"
            if reason is not None:
                counts["skipped"] += 1
                print(f"SKIP {test_id}: {reason}", flush=True)
                continue
            start = time.perf_counter()
            try:
                func(**kwargs)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # pytest's own skip is a BaseException named Skipped
                if isinstance(exc, Skipped) or type(exc).__name__ == "Skipped":
                    counts["skipped"] += 1
                    print(f"SKIP {test_id}: {exc}", flush=True)
                else:
                    counts["failed"] += 1
                    print(f"FAIL {test_id}\n{traceback.format_exc()}", flush=True)
                continue
            counts["passed"] += 1
            print(f"PASS {test_id} ({time.perf_counter() - start:.1f}s)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="test files (default: the CUDA tests)")
    p.add_argument("--stub", action="store_true", help="use the stand-in pytest even if pytest is installed")
    p.add_argument("-k", dest="keyword", help="run only tests whose id contains this")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.stub:
        install_pytest_stub()
    else:
        try:
            import pytest  # noqa: F401
        except ImportError:
            install_pytest_stub()
    stand_in = (sys.modules["pytest"].__doc__ or "").startswith("tools/")
    print(f"pytest: {'stand-in' if stand_in else 'installed'}", flush=True)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for path in args.files or DEFAULT_FILES:
        run_module(path, args.keyword, counts)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
