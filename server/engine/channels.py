"""The two ends of the link between the frontend and the engine core: `send(message)` and
`receive(timeout) -> [messages]` (everything waiting, after waiting at most `timeout` seconds for the
first one).

`ZmqChannel`: msgpack-encoded messages over a pair of ZeroMQ PUSH/PULL sockets on ipc:// paths, for an
engine core in its own process (as vLLM v1 feeds its engine core). `QueueChannel`: the same messages
as Python objects through two queues, for an engine core in a thread of the same process.
"""

from __future__ import annotations

import queue

import msgspec
import zmq


class ZmqChannel:
    """`bind`: the frontend binds (it exists first); the core connects to the same two addresses."""

    def __init__(self, send_addr: str, receive_addr: str, receive_type, *, bind: bool, linger_ms: int = 0):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receive_type)
        self.context = zmq.Context()
        self._send = self.context.socket(zmq.PUSH)
        self._receive = self.context.socket(zmq.PULL)
        for sock, addr in ((self._send, send_addr), (self._receive, receive_addr)):
            sock.setsockopt(zmq.LINGER, linger_ms)
            sock.bind(addr) if bind else sock.connect(addr)
        self._poller = zmq.Poller()
        self._poller.register(self._receive, zmq.POLLIN)

    def send(self, message) -> None:
        self._send.send(self._encoder.encode(message), copy=False)

    def receive(self, timeout: float) -> list:
        if not self._poller.poll(int(timeout * 1000)):
            return []
        messages: list = []
        while True:
            try:
                frame = self._receive.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(self._decoder.decode(frame.buffer))

    def close(self) -> None:
        self._send.close()
        self._receive.close()
        self.context.term()  # waits for each socket's linger: the last messages still go out


class QueueChannel:
    def __init__(self, outbox: queue.SimpleQueue, inbox: queue.SimpleQueue):
        self._outbox, self._inbox = outbox, inbox

    @classmethod
    def pair(cls) -> tuple[QueueChannel, QueueChannel]:
        """Two connected ends: what one sends, the other receives."""
        a: queue.SimpleQueue = queue.SimpleQueue()
        b: queue.SimpleQueue = queue.SimpleQueue()
        return cls(a, b), cls(b, a)

    def send(self, message) -> None:
        self._outbox.put(message)

    def receive(self, timeout: float) -> list:
        try:
            messages = [self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def close(self) -> None:
        pass
