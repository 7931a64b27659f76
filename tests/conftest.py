import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (tools/setup.sh has fetched it; this fetches if not)."""
    from pyserve.cli import parse_config
    from pyserve.model.default_model import ensure_default_model

    return ensure_default_model(parse_config([]).model.download_dir)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(arch, shard=False) -> directory of a tiny random model, built once per session."""
    from make_tiny_model import make_tiny_model

    made = {}

    def make(arch: str, shard: bool = False) -> Path:
        key = (arch, shard)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}{'-sharded' if shard else ''}")
            made[key] = make_tiny_model(out, arch, shard=shard)
        return made[key]

    return make
