"""Build pyserve and its native extension pyserve._C: setup.py -> CMake -> ninja.

The extension is compiled against the torch already installed in the environment, so build
without isolation: ``pip install --no-build-isolation -e .``.  CMake finds torch through
torch's own CMake config; CUDA sources are added when that torch has CUDA and nvcc exists.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def runtime_requirements() -> list[str]:
    """Package names from the runtime section of requirements.txt (versions are pinned there,
    and installed by tools/setup.sh; a CUDA machine keeps the torch it has)."""
    names = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.strip()
        if line.startswith("# build"):
            break
        if line and not line.startswith("#"):
            names.append(re.split(r"[=<>~! ]", line, maxsplit=1)[0])
    return names


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import torch  # the torch we link against, found in this environment

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("PYSERVE_BUILD_TYPE", "Release")
        configure = [
            "cmake",
            str(ROOT),
            "-G",
            "Ninja",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPYSERVE_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_dir, check=True)


setup(
    name="pyserve",
    version="0.1.0",
    description="An LLM inference server with an OpenAI-compatible API and a C++/CUDA core",
    packages=find_packages(include=["pyserve", "pyserve.*"]),
    python_requires=">=3.10",
    install_requires=runtime_requirements(),
    # `pyserve serve MODEL`, `pyserve chat`, ... as `vllm serve MODEL`, `vllm chat`
    entry_points={"console_scripts": ["pyserve = pyserve.__main__:main"]},
    ext_modules=[CMakeExtension("pyserve._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
