"""The `filemq` command: parses flags and config, calls the packages. No business logic here."""

from __future__ import annotations

import logging
import sys

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


@bench.command("codec")
@click.option("--packets", type=click.IntRange(min=1), default=200_000, show_default=True,
              help="PUBLISH packets in the decoded stream (and PUBACKs encoded).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs per measurement; the best is reported.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line on stdout.")
def bench_codec(packets: int, rounds: int, as_json: bool) -> None:
    """MQTT codec: PUBLISH decode and PUBACK encode rates, filemq vs amqtt on the same bytes."""
    import json

    from bench.codec import ratios, run_codec_bench

    results = run_codec_bench(packets, rounds, progress=lambda msg: click.echo(msg, err=True))
    for result in results:
        if as_json:
            click.echo(json.dumps(result.as_dict()))
        else:
            click.echo(f"{result.operation:15} {result.impl:7} {result.rate:>12,.0f} packets/s")
    for operation, ratio in ratios(results).items():
        if as_json:
            click.echo(json.dumps({"bench": "codec", "operation": operation, "ratio_vs_amqtt": round(ratio, 2)}))
        else:
            click.echo(f"{operation:15} filemq/amqtt = {ratio:.1f}x")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("user")
@click.option("--password-stdin", is_flag=True, help="Read the password from the first line of stdin.")
@click.option("--iterations", type=click.IntRange(min=1), default=None, hidden=True)
def passwd(file: str, user: str, password_stdin: bool, iterations: int | None) -> None:
    """Add USER to the password FILE or change their password (creates FILE, mode 0600)."""
    from filemq.auth import DEFAULT_ITERATIONS, add_or_update, valid_username
    from filemq.config import ConfigError

    if not valid_username(user):
        raise click.BadParameter("must be non-empty, without ':' or spaces", param_hint="USER")
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    if not password:
        raise click.ClickException("the password is empty; nothing written")
    try:
        new = add_or_update(file, user, password, iterations=iterations or DEFAULT_ITERATIONS)
    except (ConfigError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{'added' if new else 'updated'} user {user!r} in {file}", err=True)


if __name__ == "__main__":
    main()
