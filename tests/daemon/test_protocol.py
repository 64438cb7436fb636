"""The wire format, byte for byte, and every way a request can be refused."""

from __future__ import annotations

import pytest

from spswap.daemon import protocol
from spswap.daemon.client import error_from_response
from spswap.errors import DaemonError, PermissionDenied, PoolFull, ProtocolError, SlotError


def test_request_bytes() -> None:
    msg = protocol.request("slots.release", reservation_id="r7")
    assert protocol.encode(msg) == b'{"args":{"reservation_id":"r7"},"op":"slots.release","v":1}\n'
    assert protocol.encode(protocol.request("ping")) == b'{"args":{},"op":"ping","v":1}\n'


def test_response_bytes() -> None:
    assert (
        protocol.encode(protocol.ok({"pong": True}))
        == b'{"ok":true,"result":{"pong":true},"v":1}\n'
    )
    assert protocol.encode(protocol.error("PermissionDenied", "not yours")) == (
        b'{"error":{"message":"not yours","type":"PermissionDenied"},"ok":false,"v":1}\n'
    )


def test_decode_valid_request() -> None:
    req = protocol.decode_request(
        b'{"v":1,"op":"job.register","args":{"job_id":"12","uid":1000,"gpus":[0,1]}}\n'
    )
    assert req == protocol.Request("job.register", {"job_id": "12", "uid": 1000, "gpus": [0, 1]})
    # an optional arg given as null is the same as leaving it out
    req = protocol.decode_request(b'{"v":1,"op":"job.end","args":{"job_id":"1","requeued":null}}')
    assert req.args == {"job_id": "1"}


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b"not json\n", "not UTF-8 JSON"),
        (b"\xff\xfe\n", "not UTF-8 JSON"),
        (b"[1,2]\n", "must be a JSON object"),
        (b'{"op":"ping"}\n', "protocol version None"),
        (b'{"v":2,"op":"ping"}\n', "protocol version 2"),
        (b'{"v":true,"op":"ping"}\n', "protocol version True"),
        (
            b'{"v":1,"op":"rm -rf"}\n',
            "unknown op 'rm -rf'; valid ops: checkpoint, checkpoint.status, events.tail",
        ),
        (b'{"v":1,"op":"ping","args":[]}\n', "args of ping must be a JSON object"),
        (
            b'{"v":1,"op":"slots.reserve","args":{"model":"m","timeout_s":NaN}}\n',
            "NaN is not a number the daemon accepts",
        ),
        (
            b'{"v":1,"op":"ping","args":{"x":1}}\n',
            "unknown argument(s) ['x'] for ping; valid: none",
        ),
        (b'{"v":1,"op":"slots.release","args":{}}\n', "needs the argument 'reservation_id'"),
        (
            b'{"v":1,"op":"job.register","args":{"job_id":"1","uid":true}}\n',
            "'uid' of job.register must be int",
        ),
        (
            b'{"v":1,"op":"job.register","args":{"job_id":"1","uid":0,"gpus":["a"]}}\n',
            "must be int_list",
        ),
        (b'{"v":1,"op":"checkpoint","args":{"job_id":5}}\n', "'job_id' of checkpoint must be str"),
        (
            b'{"v":1,"op":"pool.import","args":{"files":["a"],"identity":{"x":{"y":1}}}}\n',
            "must be flat_dict",
        ),
        (
            b'{"v":1,"op":"pool.import","args":{"files":["a"],"identity":[1]}}\n',
            "must be flat_dict",
        ),
    ],
)
def test_decode_refuses(line: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=None) as info:
        protocol.decode_request(line)
    assert needle in str(info.value)


def test_flat_dict_identity_accepted() -> None:
    line = (b'{"v":1,"op":"pool.import","args":{"files":["a"],"identity":'
            b'{"engine":"vllm","tp_size":1,"x":null,"ok":true,"f":0.5}}}\n')  # fmt: skip
    req = protocol.decode_request(line)
    assert req.args["identity"]["engine"] == "vllm"
    many = {f"k{i}": i for i in range(protocol.MAX_FLAT_DICT_KEYS + 1)}
    with pytest.raises(ProtocolError, match="flat_dict"):
        protocol.request("pool.import", files=["a"], identity=many)


def test_oversized_refused() -> None:
    line = b'{"v":1,"op":"ping","args":{"pad":"' + b"x" * protocol.MAX_MESSAGE_BYTES + b'"}}\n'
    with pytest.raises(ProtocolError, match="larger than the limit of 65536"):
        protocol.decode_request(line)


def test_client_rejects_bad_call_before_sending() -> None:
    with pytest.raises(ProtocolError, match="unknown op"):
        protocol.request("nope")


def test_decode_response_shapes() -> None:
    assert protocol.decode_response(b'{"ok":true,"result":null,"v":1}\n')["result"] is None
    with pytest.raises(ProtocolError, match="neither a result nor an error"):
        protocol.decode_response(b'{"ok":true,"v":1}\n')


def test_error_types_map_back() -> None:
    assert (
        type(error_from_response({"type": "PermissionDenied", "message": "m"})) is PermissionDenied
    )
    assert type(error_from_response({"type": "SlotError", "message": "m"})) is SlotError
    # a full pool stays what it is, its message whole (the sizes are in it)
    full = error_from_response({"type": "PoolFull", "message": "your share of the pool is full"})
    assert type(full) is PoolFull and str(full) == "your share of the pool is full"
    # unknown names and non-errors stay DaemonError
    for name in ("NoSuchThing", "Path", "ValueError"):
        err = error_from_response({"type": name, "message": "boom"})
        assert type(err) is DaemonError and "boom" in str(err)


def test_refusals_cross_the_wire_as_what_they_mean() -> None:
    from spswap.errors import BadRequest, ImageRejected, RequestRefused

    for cls in (BadRequest, RequestRefused, ImageRejected):
        err = error_from_response({"type": cls.__name__, "message": "m"})
        assert type(err) is cls and str(err) == "m"
    # a client that catches DaemonError still catches the daemon's refusals
    assert issubclass(BadRequest, DaemonError) and issubclass(RequestRefused, DaemonError)
