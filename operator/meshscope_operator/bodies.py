"""HTTP answers read to a byte cap, whole: the one way the operator reads a body it asked for.

Exists because aiohttp's ``StreamReader.read(n)`` returns *up to* ``n`` bytes: whatever has arrived when it is
called, which for an answer sent in several TCP segments is its first part. Read that way, a sidecar's JSON lines
lost their tail (the last line cut, the rest missing, and no note saying so) and a store's JSON answer failed to
parse, both only when the network split the answer: once in a CI run on loopback. :func:`read_at_most` reads until
the cap or the end of the body.

It must not import kopf or the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp


async def read_at_most(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body's first ``limit`` bytes, or all of it when it is shorter: never less because it came in parts.

    Args:
        content: the response's stream (``response.content``).
        limit: bytes at most (read ``cap + 1`` to learn whether a body exceeds ``cap``).
    """
    parts: list[bytes] = []
    left = limit
    while left > 0:
        part = await content.read(left)
        if not part:  # the end of the body
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
