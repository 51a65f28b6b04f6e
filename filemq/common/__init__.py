"""The vocabulary every filemq layer shares: MQTT topic names and filters
(:mod:`.topics`) and the configuration schema with its validator (:mod:`.config`; its
value checkers and ``ConfigError`` in :mod:`.checks`, the ``--help`` text in :mod:`.keyhelp`).

May import: the standard library and its own modules (config -> checks -> topics). Must not
import any other filemq layer.
"""
