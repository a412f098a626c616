"""SGLang's bootstrap rooms (prefill side) and the emulator CLI's bootstrap options."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from fastroute.emulator import cli
from fastroute.emulator.bootstrap import BootstrapRooms, RoomFailed


def test_a_decode_waiting_first_gets_the_room_once_it_is_held() -> None:
    async def main() -> None:
        rooms = BootstrapRooms()
        waiter = asyncio.ensure_future(rooms.wait(7, timeout_s=5.0))
        await asyncio.sleep(0)
        assert rooms.waiting == 1
        rooms.held(7, "cmpl-1")
        assert await waiter == "cmpl-1"
        assert len(rooms) == 0  # one decode per room
        rooms.held(8, "cmpl-2")  # held before any decode asked
        assert rooms.waiting == 0
        assert await rooms.wait(8, timeout_s=5.0) == "cmpl-2"

    asyncio.run(main())


def test_a_room_nobody_prefills_times_out_and_is_forgotten() -> None:
    async def main() -> None:
        rooms = BootstrapRooms()
        with pytest.raises(RoomFailed, match="bootstrap_room 9 .* 0.05 s"):
            await rooms.wait(9, timeout_s=0.05)
        assert len(rooms) == 0

    asyncio.run(main())


def test_held_rooms_nobody_claims_are_bounded() -> None:
    async def main() -> None:
        rooms = BootstrapRooms(max_rooms=4)
        waiter = asyncio.ensure_future(rooms.wait(0, timeout_s=5.0))
        await asyncio.sleep(0)
        for room in range(1, 10):
            rooms.held(room, f"r{room}")
        assert len(rooms) == 4 and rooms.waiting == 1  # the waiter is never dropped
        rooms.held(0, "r0")
        assert await waiter == "r0"

    asyncio.run(main())


def test_cli_gives_each_engine_its_own_bootstrap_port() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--count", "2", "--kind", "sglang", "--role", "prefill", "--bootstrap-port", "9000",
         "--bootstrap-timeout-s", "4"]
    )  # fmt: skip
    specs = cli._specs(args)
    assert [s.bootstrap_port for s in specs] == [9000, 9001]
    assert {s.bootstrap_timeout_s for s in specs} == {4.0}
    with pytest.raises(ValueError, match="bootstrap-timeout-s"):
        cli._specs(parser.parse_args(["--bootstrap-timeout-s", "0"]))
