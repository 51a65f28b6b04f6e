"""The process contract shared by broker, agent and collector (filemq/ops/service.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from filemq.common.config import ConfigError
from filemq.ops.service import EXIT_CONFIG, EXIT_OK, EXIT_RUNTIME, serve_until_signalled

log = logging.getLogger("test.service")


class FakeService:
    def __init__(self, fail_start: BaseException | None = None, fail_stop: bool = False) -> None:
        self.fail_start, self.fail_stop = fail_start, fail_stop
        self.events: list[str] = []

    async def start(self) -> None:
        if self.fail_start is not None:
            raise self.fail_start
        self.events.append("start")

    async def stop(self) -> None:
        self.events.append("stop")
        if self.fail_stop:
            raise RuntimeError("flush failed")


class Sidecar:
    def __init__(self, svc: FakeService) -> None:
        self.svc = svc

    def shutdown(self) -> None:
        self.svc.events.append("sidecar down")


def serve(svc: FakeService, **kw: object) -> tuple[int, list[str]]:
    ready: list[str] = []

    async def main() -> int:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        return await serve_until_signalled(
            lambda: svc, name="thing", where="127.0.0.1:1 (data dir /x)",
            describe=lambda s: "thing up", log=log, ready=ready.append, stop=stop, **kw)  # type: ignore[arg-type]

    return asyncio.run(main()), ready


def test_clean_run_announces_ready_and_stops_everything() -> None:
    svc = FakeService()
    code, ready = serve(svc, sidecar=Sidecar)
    assert (code, ready) == (EXIT_OK, ["thing up"])
    assert svc.events == ["start", "stop", "sidecar down"]


@pytest.mark.parametrize(("error", "code"), [(ConfigError("bad key"), EXIT_CONFIG), (OSError(98, "in use"), EXIT_RUNTIME)])
def test_start_failures_map_to_exit_codes(error: BaseException, code: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="test.service"):
        got, ready = serve(FakeService(fail_start=error))
    assert (got, ready) == (code, [])
    assert ("configuration error" if code == EXIT_CONFIG else "cannot start the thing on 127.0.0.1:1") in caplog.text


def test_sidecar_failure_stops_the_service() -> None:
    svc = FakeService()

    def broken(_: FakeService) -> Sidecar:
        raise OSError(98, "metrics port in use")

    assert serve(svc, sidecar=broken) == (EXIT_RUNTIME, [])
    assert svc.events == ["start", "stop"]


def test_error_while_stopping_is_a_runtime_failure() -> None:
    svc = FakeService(fail_stop=True)
    assert serve(svc, sidecar=Sidecar)[0] == EXIT_RUNTIME
    assert svc.events == ["start", "stop", "sidecar down"]
