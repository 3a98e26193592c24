"""The ms-swift suite runs in `.venv-swift` (`scripts/setup.sh` builds it; `tests/test_trainer_venvs.py` starts it):
ms-swift pins a transformers older than the one the main venv's hf extra installs. It needs swift, so a
missing one fails here, at collection, rather than skipping tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))  # trainer_processes.py

import swift  # noqa: F401  (not installed: this suite belongs in .venv-swift)


@pytest.fixture(scope="session")
def swift_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint with a byte-level BPE tokenizer and the chat tokens of swift's qwen2_5 template."""
    from tiny_swift_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))
