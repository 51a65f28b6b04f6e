"""The `filemq` command: parses flags and config, calls the packages. No business logic here."""

from __future__ import annotations

import logging

import click


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """filemq: an embedded store-and-forward MQTT broker on a CRC-checked segment log."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.group()
def bench() -> None:
    """Benchmarks; each runs its baseline in the same run and prints the ratio."""


if __name__ == "__main__":
    main()
