"""Everything is configured in pyproject.toml; this file only adds `yeto-autoattach.pth`.

The .pth file must sit at the root of site-packages for Python to run it at start-up
(yeto_plugins/autoattach.py). A wheel gets it from `build_py`'s output; an editable install
(PEP 660) does not ship build output, so there `build_py` writes it into the editable wheel's
own tree (the `install` command's target while setuptools builds that wheel).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def pth_file() -> tuple[str, str]:
    """(PTH_NAME, PTH_LINE) from yeto_plugins/autoattach.py, which imports only the standard library."""
    spec = importlib.util.spec_from_file_location("_yeto_autoattach", HERE / "yeto_plugins" / "autoattach.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PTH_NAME, module.PTH_LINE


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        name, line = pth_file()
        if self.editable_mode:
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        self.mkpath(target)
        with open(os.path.join(target, name), "w", encoding="utf-8") as f:
            f.write(line)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, pth_file()[0]))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
