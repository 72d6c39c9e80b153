"""Printed FX graphs made independent of the counters FX appends to node names."""

from __future__ import annotations

import re

# a name that is not an attribute (after a dot): its base, then the counters FX appended (getitem_9, sum_1)
_NAME = re.compile(r"(?<![.\w])([A-Za-z_]\w*?)(?:_\d+)*\b")
_STRING = re.compile(r"('[^']*')")


def renumbered(lines: list[str]) -> list[str]:
    """``lines`` with the counter of each name (getitem_9, reshape_4: how many nodes of that name come before it,
    which differs between transformers versions) counted again from 0 in the order the names appear in ``lines``:
    one name is one name throughout, two names stay two, so the data flow among the lines reads as before.
    Attributes and op names (after a dot) and string literals are left as they are."""
    seen: dict[str, str] = {}
    per_base: dict[str, int] = {}

    def recount(m: re.Match) -> str:
        if m.group(0) not in seen:
            n = per_base[m.group(1)] = per_base.get(m.group(1), -1) + 1
            seen[m.group(0)] = m.group(1) + (f"_{n}" if n else "")
        return seen[m.group(0)]

    def line(text: str) -> str:
        parts = _STRING.split(text)  # the string literals at odd indices
        return "".join(p if i % 2 else _NAME.sub(recount, p) for i, p in enumerate(parts))

    return [line(x) for x in lines]
