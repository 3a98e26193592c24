"""ms-swift Megatron plugin (DESIGN §1.5): `--external_plugins .../plugin/swift_plugin.py --callbacks yeto_diloco`.

Importing this package loads neither swift nor Megatron: swift imports the plugin file on every
rank while it parses arguments, and the sync core is loaded only when training begins.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yeto_plugins.swift_megatron.callback import YetoMegatronCallback
    from yeto_plugins.swift_megatron.register import register

__all__ = ["YetoMegatronCallback", "register"]

_WHERE = {"YetoMegatronCallback": "callback", "register": "register"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
