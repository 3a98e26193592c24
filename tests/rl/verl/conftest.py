"""The verl CPU harness needs verl: without it every test in this directory is skipped.

The check is an autouse fixture rather than a module-level ``pytest.importorskip``: when this directory is
named on the command line pytest imports this file while parsing its configuration, where a module-level skip
aborts the whole run instead of skipping.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "harness"))  # trainer_processes.py


@pytest.fixture(autouse=True, scope="session")
def _requires_verl() -> None:
    pytest.importorskip("verl", reason="the verl harness tests need verl installed")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint with its tokenizer, written once per session."""
    from tiny_model import write_tiny_qwen2  # imports transformers: only once verl (and so it) is known present

    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))
