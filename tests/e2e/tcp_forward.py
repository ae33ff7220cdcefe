"""A TCP forwarder for the multi-host test (``python tests/e2e/tcp_forward.py LISTEN_HOST TARGET...``).

PostgreSQL and Redis listen on 127.0.0.1, which a network namespace cannot reach: for each
``host:port`` target this listens on ``LISTEN_HOST`` (the bridge's address on the host side) on an
ephemeral port, prints ``<port> …`` (one per target, in order) on one line once every socket is
bound, and copies bytes both ways between each accepted connection and a new one to its target.
Standard library only; it runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _handler(host: str, port: int):
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, target_writer), _pipe(target_reader, client_writer))

    return handle


async def main(listen_host: str, targets: list[str]) -> None:
    servers = []
    for target in targets:
        host, _, port = target.rpartition(":")
        servers.append(await asyncio.start_server(_handler(host, int(port)), listen_host, 0))
    print(" ".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
