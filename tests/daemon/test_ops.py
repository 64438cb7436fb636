"""The daemon's one table of ops: every op the protocol accepts has its handler there."""

from __future__ import annotations

import pytest

from spswap.daemon import protocol
from spswap.daemon.ops import HANDLERS


def test_every_protocol_op_has_a_handler_and_no_other() -> None:
    assert set(HANDLERS) == set(protocol.OPS)
    assert set(protocol.FD_OPS) <= set(HANDLERS)


def test_no_module_can_add_to_the_table() -> None:
    # the table is what ops.py lists, whatever is imported before or after it
    import spswap.daemon.ckpt_dump  # noqa: F401
    import spswap.daemon.ckpt_restore  # noqa: F401

    assert len(HANDLERS) == len(protocol.OPS)
    with pytest.raises(TypeError):
        HANDLERS["ping"] = HANDLERS["status"]  # type: ignore[index]
