"""A small process for CRIU tests: counts in memory, answers on a listening Unix socket.

Each connection gets ``"<token> <count> <sum>"`` and increments the count; ``token`` is random
per process start, so an answer after a restore proves the same memory came back.
"""

import os
import secrets
import socket
import sys


def open_io_uring() -> int:
    """An io_uring instance (x86_64 syscall 425), which CRIU cannot dump."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(425, 4, params)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "io_uring_setup failed")
    return fd


def tcp_to_itself() -> list[socket.socket]:
    """A loopback TCP connection whose both ends are this process (as torch.distributed's
    store has in a one-GPU vLLM); returns the listener and both ends, kept open."""
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as torch's TCPStore does: the restore must bind the port again while the dumped
    # connection's closed ends may still hold it (TIME_WAIT)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    client = socket.create_connection(lst.getsockname())
    server, _ = lst.accept()
    return [lst, client, server]


def main() -> None:
    path = sys.argv[1]
    token = secrets.token_hex(8)
    count = 0
    total = 0
    data = list(range(200_000))  # some heap, so an image is a few MB
    ring_fd = open_io_uring() if "--io-uring" in sys.argv else None  # noqa: F841 (kept open)
    tcp = tcp_to_itself() if "--tcp-self" in sys.argv else []  # noqa: F841 (kept open)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    with open(path + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while True:
        conn, _ = srv.accept()
        with conn:
            cmd = conn.recv(64).strip()
            if cmd == b"hold":  # keep this connection open (an outside peer) until told
                conn.sendall(b"holding\n")
                conn.recv(64)
                continue
            count += 1
            total += data[count]
            conn.sendall(f"{token} {count} {total}\n".encode())


if __name__ == "__main__":
    main()
