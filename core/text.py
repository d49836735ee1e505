"""Words for people: a count with its noun in the right number ("1 shard", "2 shards"), for messages, events and
the CLI alike."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, in the plural unless n is 1 (`plural` for nouns that do not take an s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
