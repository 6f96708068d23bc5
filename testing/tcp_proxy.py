"""A TCP proxy on loopback for tests that need a slow or unreachable server (a kube-apiserver, say)
without mocking what it speaks: bytes pass through untouched (TLS included) until the test stalls
them or refuses connections.

    with TcpProxy(("127.0.0.1", api_port)) as proxy:
        client_config.host = f"https://127.0.0.1:{proxy.port}"
        proxy.stall()     # requests reach the server only after `hold_s`: a server that answers nothing
        proxy.refuse()    # nothing listens on the port any more (connection refused), open ones are cut
        proxy.restore()   # back to passing bytes through, on the same port
        proxy.refuse_mid_answer(4096, once)  # refuse() itself once a POST's answer passed 4 KiB
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

CHUNK = 64 * 1024


class TcpProxy:
    """Forwards every connection made to 127.0.0.1:`port` to `upstream`, one thread per direction."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.hold_s = 0.0  # how long each chunk from a client waits before it goes upstream
        self._posting: dict[socket.socket, int] = {}  # client socket of a POST -> answer bytes passed
        self._cut_after: int | None = None
        self._once: threading.Event | None = None
        self.cut_mid_answer = False
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self._listen()

    # --- what a test does ----------------------------------------------------------------------

    def stall(self, hold_s: float = 3600.0) -> None:
        """From now on (also on connections already open) a client's bytes wait `hold_s` first."""
        self.hold_s = hold_s

    def refuse(self) -> None:
        """Close the listening socket (a new connection is refused) and cut every open one."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = list(self._conns), set()
        if listener is not None:
            _close(listener)  # shutdown first: it wakes the accept() blocked on it and stops listening
        for conn in conns:
            _close(conn)

    def refuse_mid_answer(self, after_bytes: int, once: threading.Event) -> None:
        """Once the answer to a POST has passed `after_bytes` (a stream under way: the server is still
        writing it, whoever reads it and however slowly), refuse() (cutting it), unless `once` is
        already set; then set it. Proxies sharing `once` cut one stream between them."""
        self._cut_after, self._once = after_bytes, once

    def restore(self) -> None:
        """Pass bytes through again without delay, listening on the same port if it was refused."""
        self.hold_s = 0.0
        if self._listener is None:
            self._listen()

    def close(self) -> None:
        self.hold_s = 0.0
        self.refuse()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- the plumbing ----------------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy-accept").start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by refuse()
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # refused meanwhile
                    _close(client)
                    _close(server)
                    continue
                self._conns |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, held: bool) -> None:
        try:
            while data := src.recv(CHUNK):
                if held:
                    self._hold(src)
                    if data.startswith(b"POST "):  # polls are GETs
                        self._posting[src] = 0
                elif dst in self._posting:
                    self._posting[dst] += len(data)
                    if self._should_cut(self._posting[dst]):
                        self.cut_mid_answer = True
                        self.refuse()
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def _should_cut(self, answered: int) -> bool:
        if self._cut_after is None or self._once is None or answered < self._cut_after:
            return False
        with self._lock:
            if self._once.is_set():
                return False
            self._once.set()
            return True

    def _hold(self, conn: socket.socket) -> None:
        """Wait out `hold_s` (re-read as it changes: restore() releases what waits), or the
        connection's end."""
        start = time.monotonic()
        while time.monotonic() - start < self.hold_s and conn in self._conns:
            time.sleep(0.01)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
