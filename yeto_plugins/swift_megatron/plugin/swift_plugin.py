"""ms-swift plugin file: `megatron sft ... --external_plugins <this file> --callbacks yeto_diloco`.

swift imports this file by path on every rank (`swift.utils.import_external_file`) before it
builds the trainer; importing it registers yeto's Megatron callback. yeto reads its settings
from `YETO_DILOCO_*` only. `YETO_DILOCO_AUTO_ATTACH=1` attaches it without `--callbacks`.
"""

import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# swift put this folder first on sys.path to import this file; take it off again. (It may put it
# back on a later import of the same file, e.g. in dataloader workers: this folder holds nothing
# else, so nothing can be shadowed.)
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == _HERE:
    del sys.path[0]
if importlib.util.find_spec("yeto_plugins") is None:  # a checkout, not installed: use this file's repository
    sys.path.append(str(_HERE.parents[2]))

from yeto_plugins.swift_megatron.register import register  # noqa: E402

register()
