"""A throttling TCP proxy for the slow-Redis tests (``test_l2_slow.py``).

:class:`DripProxy` listens on 127.0.0.1 (a free port) and forwards every
connection to ``upstream`` in both directions, at most ``rate`` bytes per
second (None: as fast as they come), so a real ``redis-server`` behind it
answers slowly but never stops answering: each socket read sees a byte well
within any timeout, which is what a per-read timeout cannot catch. The rate
can be changed while connections are open. It runs an asyncio loop on its
own thread; :meth:`close` stops it and every connection.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional


class DripProxy:
    def __init__(self, upstream_host: str, upstream_port: int,
                 rate: Optional[float] = None) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rate = rate                    # bytes per second, each direction of each connection
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server = None
        self._tasks: set = set()
        self._thread = threading.Thread(target=self._run, name="drip-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            ur, uw = await asyncio.open_connection(*self.upstream)
        except OSError:
            cw.close()
            return
        pumps = [asyncio.ensure_future(self._pump(cr, uw)), asyncio.ensure_future(self._pump(ur, cw))]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for t in pumps:
            t.cancel()
            self._tasks.discard(t)
        for w in (cw, uw):
            w.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await r.read(65536)
                if not data:
                    return
                while data:                  # the rate now, whatever it was when read
                    rate = self.rate
                    n = len(data) if rate is None else max(1, int(rate // 20))
                    if rate is not None:
                        await asyncio.sleep(min(n, len(data)) / rate)
                    w.write(data[:n])
                    data = data[n:]
                    await w.drain()
        except (OSError, asyncio.CancelledError):
            return

    def close(self) -> None:
        def stop():
            for t in list(self._tasks):
                t.cancel()
            self._server.close()
            self._loop.stop()
        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)
