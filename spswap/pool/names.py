"""What a pool entry may be named, and how a reference (digest, prefix or name) is read.

Names are chosen by whoever imports, digests by the content. A name made of hex digits
could be read as a digest prefix: a user could name her entry after the first digits of
another user's digest and be handed out in its place. So such names are refused when an
entry is written, and a reference that looks like a digest is only ever matched against
digests (an entry named that way before the check stays reachable by its digest).
"""

from __future__ import annotations

import re

from spswap.errors import PoolError

MIN_PREFIX_CHARS = 6
"""The fewest hex digits a digest prefix may have (shorter ones match too much)."""
DIGEST_CHARS = 64
_DIGEST_LIKE = re.compile(rf"[0-9a-fA-F]{{{MIN_PREFIX_CHARS},{DIGEST_CHARS}}}")


def looks_like_digest(ref: str) -> bool:
    """True when ``ref`` could be a digest or a digest prefix (6 to 64 hex digits)."""
    return _DIGEST_LIKE.fullmatch(ref) is not None


def check_entry_name(name: str) -> None:
    """Refuse a name that a reference could mistake for a digest."""
    if looks_like_digest(name):
        raise PoolError(
            f"entry name {name!r} looks like a digest (only hex digits, {MIN_PREFIX_CHARS} "
            "or more), and references that look like digests are matched against digests "
            "only; import it under another name: spswap pool import PATH --name NAME"
        )
