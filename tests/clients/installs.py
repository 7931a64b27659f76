"""The real clients, pinned, installed from their registries on first use and cached between
runs on the same machine under ~/.cache/pyserve-clients/<name>-<version>[-<pins digest>] (or
$PYSERVE_CLIENTS_CACHE): npm packages with npm, Python packages each in a virtual
environment of its own (their pins conflict with each other's and with pyserve's).

An install is made in a temporary folder beside its final one and renamed into place when it
has finished, under a lock, so a run that was killed leaves no half install and two runs at
once install once. Installing is the one time the network is used; the tests themselves run
the clients offline (offline.py)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

_ARCH = {"x86_64": "x64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
# name -> (package, version, its command under node_modules). Claude Code's command is its
# platform package's native binary: its own bin is a stub that a postinstall script replaces,
# and no install script runs here
NPM = {
    "codex": ("@openai/codex", "0.169.0", ".bin/codex"),
    "claude-code": ("@anthropic-ai/claude-code", "2.1.328",
                    f"@anthropic-ai/claude-code-linux-{_ARCH}/claude"),
}
# name -> (version, the pip requirements of its environment)
PYTHON = {
    "litellm": ("1.110.2", ["litellm==1.110.2"]),
    # torch named first: the CPU build on this disk, not a CUDA build of several GB
    "lm-eval": ("0.4.13", ["torch==2.13.0", "transformers==5.24.0", "accelerate==1.15.0",
                           "lm_eval[api]==0.4.13"]),
    "aider": ("0.86.2", ["aider-chat==0.86.2"]),
}
INSTALL_TIMEOUT_S = 1200


def cache_root() -> Path:
    return Path(os.environ.get("PYSERVE_CLIENTS_CACHE") or Path.home() / ".cache" / "pyserve-clients")


def _installed(name: str, version: str, install) -> Path:
    """The finished install of name-version, made by install(folder) if there is none yet."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{version}"
    if (final / ".complete").exists():
        return final
    with open(root / f".{name}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").exists():  # another run installed it while this one waited
            return final
        staging = root / f".{name}-{version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        started = time.monotonic()
        install(staging)
        (staging / ".complete").write_text(f"installed in {time.monotonic() - started:.0f} s\n")
        staging.rename(final)
    return final


def _run(argv: list[str], cwd: Path | None = None) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")


def npm_client(name: str) -> Path:
    """The path of the pinned npm client's command."""
    package, version, command = NPM[name]

    def install(folder: Path) -> None:
        folder.mkdir(parents=True)
        # no install scripts: both packages ship their platform binary as an optional
        # dependency of the same version, and nothing needs fetching at install time
        _run(["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund",
              "--ignore-scripts", "--no-update-notifier", f"{package}@{version}"])

    return _installed(name, version, install) / "node_modules" / command


def python_client(name: str) -> Path:
    """The bin folder of the pinned Python client's own virtual environment. Run its
    programs as `bin/python -m module`: the scripts beside it start with the path of the
    folder the environment was built in, which is renamed into place."""
    version, requirements = PYTHON[name]

    def install(folder: Path) -> None:
        _run([sys.executable, "-m", "venv", str(folder)])
        _run([str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", "--progress-bar", "off",
              "--disable-pip-version-check", *requirements])

    # the requirements' digest in the folder's name: a changed pin is a new install
    digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:8]
    return _installed(name, f"{version}-{digest}", install) / "bin"
