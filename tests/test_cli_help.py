"""`filemq broker|agent|collector --help` reads like a man page (issue 11 item 10).

Every flag says what it does (not just its config key), shows its range and a default that
is the validator's own default (cli.py, filemq/common/keyhelp.py ``key_help``), and the flags are
grouped in sections (listener, security, limits, log, upstream).
"""

from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

import cli
from filemq.common.config import Config, key_of_param
from filemq.common.keyhelp import HELP_SECTIONS

SECTION_OF = {"broker": "broker", "agent": "agent", "collector": "collector"}


def _options(command: str) -> list[click.Option]:
    cmd = cli.main.commands[command]
    return [p for p in cmd.params if isinstance(p, click.Option)]


def _validator_default(key: str) -> object:
    section, _, name = key.rpartition(".")
    obj: object = getattr(Config(), section) if section else Config()
    return getattr(obj, name)


@pytest.mark.parametrize("command", sorted(SECTION_OF))
def test_every_flag_has_a_meaning_and_the_validators_default(command: str) -> None:
    checked = 0
    for opt in _options(command):
        assert opt.help, f"{command} {opt.opts} has no help"
        assert not opt.help.startswith("Config key"), f"{command} {opt.opts}: {opt.help}"
        key = key_of_param(SECTION_OF[command], opt.name or "")
        if key is None:
            continue
        checked += 1
        assert opt.help.count("[default: ") == 1, f"{command} {opt.opts} shows no default: {opt.help}"
        shown = opt.help.split("[default: ")[1].removesuffix("]")
        default = _validator_default(key)
        if default is None or default == ():
            assert shown == "none" or shown.startswith("none ("), (key, shown)
            continue
        # The shown default, given back as the flag's value, is the validator's default.
        section, _, name = key.rpartition(".")
        cls = type(getattr(Config(), section)) if section else Config
        check = next(f for f in dataclasses.fields(cls) if f.name == name).metadata["check"]
        assert check(shown, True) == default, (key, shown, default)
    assert checked >= 20


@pytest.mark.parametrize("command", sorted(SECTION_OF))
def test_help_is_grouped_in_sections_with_ranges_and_defaults(command: str) -> None:
    out = CliRunner().invoke(cli.main, [command, "--help"], terminal_width=100)
    assert out.exit_code == 0, out.output
    text = out.output
    titles = [t for t in HELP_SECTIONS.values() if f"\n{t}:\n" in text]
    expected = {"broker": {"listener", "security", "limits", "log"},
                "agent": {"upstream", "listener", "security", "limits", "log"},
                "collector": {"landing", "listener", "security", "limits", "log"}}[command]
    assert {HELP_SECTIONS[g] for g in expected} <= set(titles), titles
    assert "Config key" not in text
    assert "[default: 1 MiB]" in text  # max_packet_size: a size, as the validator reads it
    assert "an integer 1-65535" in text  # max_inflight's range
    if command == "agent":
        upstream = text.split(f"\n{HELP_SECTIONS['upstream']}:\n")[1].split("\n\n")[0]
        assert "--collector" in upstream and "--batch-bytes" in upstream and "--max-inflight" not in upstream
