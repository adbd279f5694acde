"""A TCP forwarder to PostgreSQL that a test can take down, as a database restart or a network
outage would: every open connection dropped and new ones refused, until it comes back up."""

import contextlib
import socket
import threading

from metering.testing import free_port


class DatabaseLink:
    def __init__(self, target=("127.0.0.1", 5432)) -> None:
        self.target, self.port = target, free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.sockets: list[socket.socket] = []
        self.is_down = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.is_down:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def down(self) -> None:
        """Drop every connection and refuse new ones until up()."""
        self.is_down = True
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.sockets = []

    def up(self) -> None:
        self.is_down = False

    def cut(self) -> None:
        """Down for good: the listening socket closes too."""
        self.down()
        # shutdown() wakes the blocked accept(); close() alone leaves the socket listening.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.close()

    def close(self) -> None:
        self.listener.close()
