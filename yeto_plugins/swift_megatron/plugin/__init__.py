"""Holds only `swift_plugin.py`, the file given to `--external_plugins`: swift puts this folder on
`sys.path` each time it imports a plugin, so nothing else may live here to shadow other modules."""
