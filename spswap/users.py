"""Users as people read them: a login name where the node's user database knows the uid."""

from __future__ import annotations

import pwd


def user_name(uid: int) -> str | None:
    """The login name of ``uid``; None where the user database does not know it (a uid
    from another node's files, a user since removed)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def user_label(uid: int) -> str:
    """A uid for a table cell: its name (``alice``), else ``uid 1001``."""
    return user_name(uid) or f"uid {uid}"


def user_cell(uid: object, missing: str = "-") -> str:
    """A uid read from a file, for a table cell: :func:`user_label` of an int, else
    ``missing`` (a record written before it named its owner)."""
    return user_label(uid) if isinstance(uid, int) else missing


def user_and_uid(uid: int) -> str:
    """A uid for a message that names its owner: ``alice, uid 1001`` (``uid 1001`` where
    the name is unknown)."""
    name = user_name(uid)
    return f"{name}, uid {uid}" if name else f"uid {uid}"
