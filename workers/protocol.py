"""Messages between the supervisor and its workers (msgspec, MessagePack).

One tagged union per direction; each connection reuses one encoder and one
decoder. MessagePack decoding cannot run code, unlike pickle.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec


class Request(msgspec.Struct, tag="request"):
    id: int
    prompt: list[int]
    max_new_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    salt: Optional[str] = None


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    worker: int
    pid: int


class Done(msgspec.Struct, tag="done"):
    id: int
    worker: int
    prompt_tokens: int
    cached_tokens: int
    outputs: list[list[int]]
    ttft_s: float
    preemptions: int


class Failed(msgspec.Struct, tag="failed"):
    id: int
    worker: int
    error: str


ToWorker = Union[Request, Shutdown]
FromWorker = Union[Ready, Done, Failed]


class Channel:
    """One end of a duplex ``multiprocess`` connection carrying these messages."""

    def __init__(self, conn, incoming) -> None:
        self.conn = conn
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(incoming)

    def send(self, msg) -> None:
        self.conn.send_bytes(self._enc.encode(msg))

    def recv(self):
        return self._dec.decode(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)
