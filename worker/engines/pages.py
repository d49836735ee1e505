"""The fast engine's pages (worker/engines/fastgen.py): which are free, which sequences use, and which hold a prompt
prefix that later rows can reuse (issue 26: a shared prefix computed once).

A page holds PAGE positions of K/V. A sequence takes the pages its prompt + max_new_tokens need and gives them back
when it finishes. A page that is full of prompt tokens is also *registered* under its tokens and the page before it
(`Prefix`): a later row whose prompt starts with the same tokens shares those pages (reference-counted, read-only:
decode writes only into a sequence's own pages past its prompt) and prefills only the rest. A registered page that
no sequence uses stays cached and is evicted least recently used first when the engine needs room, so the prefix
survives across the rows of a job and across jobs on a resident engine until the cache is needed for something else.

Keys are exact, not hashes of hashes: (the id of the entry for the page before, the page's tokens). Entry ids are
never reused, so an entry whose parent page was evicted can never match again (it is unreachable and evicted in
its turn).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

_ids = itertools.count(1)  # entry ids: 0 is the root (no page before)


@dataclass
class Entry:
    id: int
    page: int
    key: tuple


@dataclass
class Pool:
    """Pages 1..count-1 of a paged cache (page 0 is the trash page, never handed out)."""

    count: int
    free: list[int] = field(default_factory=list)
    refs: dict[int, int] = field(default_factory=dict)  # page -> sequences using it
    entries: dict[tuple, Entry] = field(default_factory=dict)  # key -> registered page
    by_page: dict[int, Entry] = field(default_factory=dict)
    idle: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # registered, unused: LRU first
    reused: int = 0  # pages shared instead of prefilled, since the pool was made

    def __post_init__(self):
        self.free = list(range(self.count - 1, 0, -1))

    def start_run(self) -> None:
        """A new run: no sequence holds a page; registered pages stay cached (idle), the others are free."""
        self.refs.clear()
        for page in self.by_page:
            if page not in self.idle:
                self.idle[page] = None
        self.free = [p for p in range(self.count - 1, 0, -1) if p not in self.by_page]

    def available(self) -> int:
        """Pages a sequence could take now: free ones and cached ones no sequence uses."""
        return len(self.free) + len(self.idle)

    def match(self, blocks: list[tuple]) -> list[int]:
        """The pages registered for the longest run of `blocks` (each PAGE prompt tokens) from the start."""
        pages, parent = [], 0
        for block in blocks:
            entry = self.entries.get((parent, block))
            if entry is None:
                break
            pages.append(entry.page)
            parent = entry.id
        return pages

    def cost(self, shared: list[int], total: int) -> int | None:
        """New pages a sequence of `total` pages needs beside `shared` ones, or None if they do not fit now (the
        shared pages that are idle stop being available once shared)."""
        new = total - len(shared)
        room = self.available() - sum(1 for p in shared if p in self.idle)
        return new if new <= room else None

    def take(self, shared: list[int], new: int) -> list[int]:
        """Share `shared` pages and take `new` more (free ones first, then the least recently used cached ones,
        which are unregistered); returns the sequence's pages."""
        for page in shared:
            self.idle.pop(page, None)
            self.refs[page] = self.refs.get(page, 0) + 1
        self.reused += len(shared)
        taken = []
        for _ in range(new):
            page = self.free.pop() if self.free else self._evict()
            self.refs[page] = 1
            taken.append(page)
        return shared + taken

    def register(self, pages: list[int], blocks: list[tuple]) -> list[int]:
        """Register `pages[i]` under `blocks[i]` (a sequence's full prompt pages, from its first), where no page is
        registered for that block yet. Returns the pages newly registered (their K/V is written by the sequence's
        prefill)."""
        added, parent = [], 0
        for page, block in zip(pages, blocks):
            key = (parent, block)
            entry = self.entries.get(key)
            if entry is None:
                if page in self.by_page:  # this page is already another block's (a shared page): stop here
                    break
                entry = Entry(next(_ids), page, key)
                self.entries[key] = entry
                self.by_page[page] = entry
                added.append(page)
            elif entry.page != page:
                break  # the block is cached in another page than this sequence's: later blocks chain from that one
            parent = entry.id
        return added

    def give_back(self, pages: list[int]) -> None:
        """A finished sequence's pages: registered ones stay cached (idle, most recent), the others are free."""
        for page in pages:
            left = self.refs.get(page, 1) - 1
            if left > 0:
                self.refs[page] = left
                continue
            self.refs.pop(page, None)
            if page in self.by_page:
                self.idle[page] = None
                self.idle.move_to_end(page)
            else:
                self.free.append(page)

    def forget(self, pages) -> None:
        """Unregister `pages` (registered, but their prefill was never launched: their K/V is not there)."""
        for page in pages:
            entry = self.by_page.pop(page, None)
            if entry is not None:
                del self.entries[entry.key]
                self.idle.pop(page, None)
                if page not in self.refs:
                    self.free.append(page)

    def _evict(self) -> int:
        page, _ = self.idle.popitem(last=False)
        entry = self.by_page.pop(page)
        del self.entries[entry.key]
        return page


def blocks(ids: list[int], page: int) -> list[tuple]:
    """The full pages of a prompt, as token tuples (a last partial page is not a block)."""
    return [tuple(ids[i : i + page]) for i in range(0, len(ids) - page + 1, page)]
