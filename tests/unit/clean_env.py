"""A fixture for settings tests: no `YETO_*` variable of the machine running the suite leaks in."""

import os

import pytest


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("YETO_"):
            monkeypatch.delenv(name)
