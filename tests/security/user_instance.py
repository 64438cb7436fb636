"""The part of a stand-in user instance (a script the test user runs on /usr/bin/python3,
without spswap on its path) that asks spswapd to checkpoint it: one JSON line on the
daemon's socket, as `spswap serve` sends at a stop. Put before each script's own text;
``ask_checkpoint`` returns the reply's bytes."""

ASK_CHECKPOINT = """
import json, socket
def ask_checkpoint(sock_path, job, ident):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    msg = {"v": 1, "op": "checkpoint", "args": {"job_id": job, **ident}}
    s.sendall(json.dumps(msg).encode() + b"\\n")
    reply = b""
    while not reply.endswith(b"\\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
    s.close()
    return reply
"""
