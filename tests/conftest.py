"""Test set-up. Tests write nothing into the source tree: CuTeDSL artifacts (``--keep-ptx`` and
friends, whose dump folder CuTeDSL fixes at import time from the working directory) and the
hypothesis example database go to one temporary folder, removed at the end of the session.
This runs before any test module imports cutlass."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_SCRATCH = Path(tempfile.mkdtemp(prefix="moe_ep_tests_"))
(_SCRATCH / "cute_dsl_dump").mkdir()  # CuTeDSL does not create it (the PTX would silently be empty)
os.environ.setdefault("CUTE_DSL_DUMP_DIR", str(_SCRATCH / "cute_dsl_dump"))  # subprocesses inherit it
# the disk compile cache of the tests' kernels lives (and dies) with the test session, never in ~/.cache
os.environ.setdefault("MOE_EP_CACHE_DIR", str(_SCRATCH / "compile_cache"))

import hypothesis  # noqa: E402
import hypothesis.configuration  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

# hypothesis' storage (example database and caches) defaults to ./.hypothesis in the working directory
hypothesis.configuration.set_hypothesis_home_dir(_SCRATCH / "hypothesis")
hypothesis.settings.register_profile(
    "moe_ep", database=DirectoryBasedExampleDatabase(str(_SCRATCH / "hypothesis" / "examples")))
hypothesis.settings.load_profile("moe_ep")

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SCRATCH, ignore_errors=True)


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
