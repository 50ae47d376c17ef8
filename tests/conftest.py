import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and ngpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        for n in (2, 4, 8):
            if f"gpu_{n}" in item.keywords and ngpu < n:
                item.add_marker(pytest.mark.skip(reason=f"needs {n} CUDA GPUs"))


@pytest.fixture
def repo_root() -> Path:
    return REPO
