"""A small process for CRIU tests: counts in memory, answers on a listening Unix socket.

Each connection gets ``"<token> <count> <sum>"`` and increments the count; ``token`` is random
per process start, so an answer after a restore proves the same memory came back.
"""

import ctypes
import hashlib
import mmap
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


def linked_map(directory: str, token: str):  # noqa: ANN201 - an mmap
    """A shared mapping of a file reached by a deleted name while another name links it,
    made as glibc's sem_open makes a named semaphore (temporary name, link, unlink): CRIU
    needs --link-remap for it. The count is written into it on every request."""
    import mmap

    final = os.path.join(directory, f"sem.{token}")
    tmp = final + ".tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    mapped = mmap.mmap(fd, 4096, mmap.MAP_SHARED)
    os.close(fd)
    os.link(tmp, final)
    os.unlink(tmp)
    return mapped


def anon_region(size_mib: int) -> mmap.mmap:
    """A private anonymous region of ``size_mib`` MiB, every page written (a CUDA
    checkpoint's host copy of GPU state is such a region, GBs), no huge pages advised."""
    region = mmap.mmap(-1, size_mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block = bytes(range(256)) * 4096  # 1 MiB, not zeros: every page is dumped
    for off in range(0, size_mib << 20, len(block)):
        region[off : off + len(block)] = block[::-1] if (off >> 20) % 2 else block
    return region


MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # (Linux's; Python names it from 3.13)


def sparse_region(size_mib: int) -> mmap.mmap:
    """A private anonymous region of ``size_mib`` MiB with one written page per 2 MiB (a
    reserved arena); MAP_NORESERVE keeps the kernel from merging it with a dense one."""
    region = mmap.mmap(-1, size_mib << 20,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)  # fmt: skip
    for off in range(0, size_mib << 20, 2 << 20):
        region[off] = 1
    return region


def address(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def main() -> None:
    path = sys.argv[1]
    token = secrets.token_hex(8)
    count = 0
    total = 0
    data = list(range(200_000))  # some heap, so an image is a few MB
    ring_fd = open_io_uring() if "--io-uring" in sys.argv else None  # noqa: F841 (kept open)
    tcp = tcp_to_itself() if "--tcp-self" in sys.argv else []  # noqa: F841 (kept open)
    sem_dir = sys.argv[sys.argv.index("--linked-map") + 1] if "--linked-map" in sys.argv else None
    shared = linked_map(sem_dir, token) if sem_dir else None
    anon = anon_region(int(sys.argv[sys.argv.index("--anon-mib") + 1])) if (
        "--anon-mib" in sys.argv) else None  # fmt: skip
    sparse = sparse_region(int(sys.argv[sys.argv.index("--sparse-mib") + 1])) if (
        "--sparse-mib" in sys.argv) else None  # fmt: skip
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    with open(path + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while True:
        conn, _ = srv.accept()
        with conn:
            cmd = conn.recv(64).strip()
            if cmd == b"tcp":  # a round trip over the TCP connection to itself
                try:
                    tcp[1].sendall(b"ping")
                    tcp[2].settimeout(2)
                    conn.sendall(b"tcp " + tcp[2].recv(16) + b"\n")
                except OSError as e:
                    conn.sendall(f"tcp error {e}\n".encode())
                continue
            if cmd == b"anon" and anon is not None:  # what the large region holds
                conn.sendall(hashlib.sha256(anon).hexdigest().encode() + b"\n")
                continue
            if cmd == b"where" and anon is not None and sparse is not None:
                conn.sendall(f"{address(anon):x} {address(sparse):x}\n".encode())
                continue
            if cmd == b"hold":  # keep this connection open (an outside peer) until told
                conn.sendall(b"holding\n")
                conn.recv(64)
                continue
            count += 1
            total += data[count]
            if shared is not None:
                shared[:16] = f"{count:16d}".encode()
            conn.sendall(f"{token} {count} {total}\n".encode())


if __name__ == "__main__":
    main()
