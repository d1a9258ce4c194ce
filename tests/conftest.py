import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, os.cpu_count() or 1))

from tiny_models import make_checkpoint  # noqa: E402

_CACHE: dict[str, tuple[Path, object]] = {}


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(name) -> (folder, transformers model) built once per session."""

    def get(name: str):
        if name not in _CACHE:
            folder = tmp_path_factory.mktemp(f"gemma4_{name}")
            model = make_checkpoint(folder, name)
            _CACHE[name] = (folder, model)
        return _CACHE[name]

    return get
