"""Prefix cache: a radix tree over token ids whose edges are KV pages.

Each node below the root owns one KV page and the tokens stored in it: a full page (S tokens)
or, at a leaf, a partial page (fewer than S). Children are keyed by their exact token tuple, so
walking full pages is a dict lookup per page. Matching is token-granular: after the last full
page that matches, the child sharing the longest prefix with the rest of the query (full or
partial) contributes its first r tokens, which the caller copies into a private page
(copy-on-write), because a shared page is never written.

Reference counts: a request that reuses a node holds a reference until it finishes; nodes with
no references and no children are evictable, least recently used first. Eviction returns page
ids to the allocator: the tree is the only owner of the pages it holds.

Recurrent checkpoints (hybrid models): a checkpoint of the state after tokens [0, b) hangs on
the node holding token b - 1, so it lives exactly as long as the KV it needs, and two sessions
branching from one prefix share it. Evicting a node releases its checkpoints
(`release_checkpoint`, set by the engine); a checkpoint pool that drops one for space calls
`forget_checkpoint`. Hanging one tells the pool which checkpoint is next above it on its path
(`link_checkpoint`): what a request would resume from if the pool dropped it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.engine.kv.pool import PageAllocator


@dataclass(slots=True, eq=False)
class Node:
    tokens: tuple[int, ...]
    page: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    ref: int = 0
    last_used: int = 0
    depth: int = 0  # pages above this one: its tokens start at depth * page size
    checkpoints: dict[int, Any] = field(default_factory=dict)  # boundary -> Checkpoint


@dataclass(slots=True)
class PrefixMatch:
    """What a new sequence can reuse: `nodes` (full pages, to lock) and optionally the first
    `partial_tokens` tokens of `partial`'s page (to copy)."""

    nodes: list[Node]
    partial: Node | None = None
    partial_tokens: int = 0

    def n_tokens(self, page_size: int) -> int:
        return len(self.nodes) * page_size + self.partial_tokens


@dataclass(slots=True)
class CheckpointMatch:
    """The deepest checkpoint usable for a query: the state after tokens [0, boundary), on
    `node`; `node` also holds the KV page of token boundary - 1."""

    boundary: int
    checkpoint: Any
    node: Node


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        self.page_size = page_size
        self.allocator = allocator
        self.root = Node((), -1, None)
        self.clock = 0  # uses of the tree (matches and inserts): the LRU time
        self.n_pages = 0  # pages held by the tree
        # Bumped by every change a reader of node refs and recency could see (uses, locks,
        # unlocks, evictions): MemoryManager recounts cached pages only when it moved.
        self.version = 0
        self.release_checkpoint: Callable[[Any], None] = lambda ckpt: None
        self.link_checkpoint: Callable[[Any, Any], None] = lambda ckpt, prev: None

    def _tick(self) -> int:
        self.clock += 1
        self.version += 1
        return self.clock

    # --- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> PrefixMatch:
        s = self.page_size
        node, nodes, pos = self.root, [], 0
        now = self._tick()
        while pos + s <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + s]))
            if child is None:
                break
            child.last_used = now
            nodes.append(child)
            node, pos = child, pos + s
        best, best_r = None, 0
        rest = tokens[pos : pos + s]
        if rest:
            for child in node.children.values():
                r = _common_prefix(child.tokens, rest)
                if r > best_r:
                    best, best_r = child, r
        if best is not None:
            best.last_used = now
        return PrefixMatch(nodes, best, best_r)

    def cached_pages_of(self, tokens: list[int]) -> list[Node]:
        """The nodes holding the full pages of `tokens` from the start. A look only: no use
        recorded (the LRU clock and recency stay as they are)."""
        s, node, path = self.page_size, self.root, []
        while (len(path) + 1) * s <= len(tokens):
            n = len(path)
            node = node.children.get(tuple(tokens[n * s : (n + 1) * s]))
            if node is None:
                break
            path.append(node)
        return path

    def lock(self, nodes: list[Node]) -> None:
        self.version += 1
        for n in nodes:
            n.ref += 1

    def unlock(self, nodes: list[Node]) -> None:
        self.version += 1
        for n in nodes:
            if n.ref <= 0:
                raise AssertionError("radix node unlocked more often than locked")
            n.ref -= 1

    # --- insertion ----------------------------------------------------------------------
    def insert(
        self,
        tokens: list[int],
        pages: list[int],
        owned: list[Node | None],
        full_pages_only: bool = False,
    ) -> list[Node | None]:
        """Offer a sequence's pages to the tree.

        tokens: the tokens whose KV is in `pages` (len <= len(pages) * S).
        owned[i]: the node the caller already locks for page i, or None if page i is private.
        Returns nodes[i]: the node now caching page i's tokens, locked for the caller (so its
        references cover every shared page it uses), or None where page i stays private
        because there is nothing to cache in it. When another page already caches those tokens
        (a request that recomputed a cached prefix: a hybrid model resuming from an earlier
        checkpoint, or one that reused nothing), that node is returned: its page differs from
        the caller's, which the caller frees and replaces by the node's (the same K/V), so the
        tree never keeps a chain pinned under a private duplicate. A partial last page is cached
        only when `full_pages_only` is False: a running sequence still writes into its last
        page.
        """
        s = self.page_size
        now = self._tick()
        node: Node | None = self.root
        result: list[Node | None] = []
        for i, page in enumerate(pages):
            chunk = tuple(tokens[i * s : (i + 1) * s])
            if owned[i] is not None:
                node = owned[i]
                result.append(node)
                continue
            if node is None or not chunk or (full_pages_only and len(chunk) < s):
                node = None  # nothing below a partial page, nothing past the tokens
                result.append(None)
                continue
            existing = node.children.get(chunk)
            if existing is not None:
                existing.last_used = now  # cached first by another sequence: ours is a copy
                existing.ref += 1
                result.append(existing)
            else:
                existing = Node(chunk, page, node, ref=1, last_used=now, depth=i)
                node.children[chunk] = existing
                self.n_pages += 1
                result.append(existing)
            node = existing if len(chunk) == s else None
        return result

    # --- recurrent checkpoints -------------------------------------------------------------
    def holders(self, tokens: list[int], boundary: int) -> list[Node]:
        """The cached nodes whose page holds token boundary - 1 of `tokens` with everything up
        to it equal (ancestors included): the one caching the query's own full page first,
        then pages of other branches sharing those tokens."""
        s = self.page_size
        last = (boundary - 1) // s
        node = self.root
        for i in range(last):
            node = node.children.get(tuple(tokens[i * s : (i + 1) * s]))
            if node is None:
                return []
        want = tuple(tokens[last * s : boundary])
        found = [c for c in node.children.values() if c.tokens[: len(want)] == want]
        own = tuple(tokens[last * s : (last + 1) * s])
        return sorted(found, key=lambda c: c.tokens != own)

    def attach_checkpoint(self, tokens: list[int], boundary: int, ckpt: Any) -> bool:
        """Hang `ckpt` (the state after tokens[:boundary]) on a node holding token
        boundary - 1. False when no cached node holds it, or one already has a checkpoint
        there (branches share it): the caller releases the checkpoint."""
        nodes = self.holders(tokens, boundary)
        if not nodes or any(boundary in n.checkpoints for n in nodes):
            return False
        nodes[0].checkpoints[boundary] = ckpt
        ckpt.owner = nodes[0]
        self.link_checkpoint(ckpt, self._checkpoint_above(nodes[0], boundary))
        return True

    @staticmethod
    def _checkpoint_above(node: Node, boundary: int) -> Any | None:
        """The deepest checkpoint before `boundary` on the path ending at `node`: its own
        shallower ones, else the nearest ancestor's deepest. A walk up the path, which stops at
        the first node holding one (anchors are a turn apart; the first of a history walks to
        the root once)."""
        below = [b for b in node.checkpoints if b < boundary]
        while not below:
            node = node.parent
            if node is None:
                return None
            below = list(node.checkpoints)
        return node.checkpoints[max(below)]

    def forget_checkpoint(self, ckpt: Any) -> None:
        """The checkpoint pool dropped `ckpt` for space."""
        node = ckpt.owner
        if node is not None and node.checkpoints.get(ckpt.boundary) is ckpt:
            del node.checkpoints[ckpt.boundary]
        ckpt.owner = None

    def deepest_checkpoint(self, tokens: list[int], match: PrefixMatch) -> CheckpointMatch | None:
        """The checkpoint at the largest boundary b such that tokens[:b] is cached (b at most
        the matched length): at every level of the matched path, among the children of the
        node above (the matched node itself, and its siblings, each matching the query for its
        own number of tokens), and among the children below the last matched node. Siblings
        count because `attach_checkpoint` hangs a checkpoint on one node of the branches
        sharing its tokens (often the request's own partial page): a later query whose path
        runs through another full page of the same tokens missed it and re-prefilled more."""
        s = self.page_size
        best: CheckpointMatch | None = None

        def consider(node: Node, limit: int) -> None:
            nonlocal best
            for b, ckpt in node.checkpoints.items():
                if b <= limit and (best is None or b > best.boundary):
                    best = CheckpointMatch(b, ckpt, node)

        parents = [self.root, *match.nodes]  # the node above each level, and the last one
        for level, parent in enumerate(parents):
            pos = level * s
            rest = tokens[pos : pos + s]
            if not rest:
                break
            for child in parent.children.values():
                if child.checkpoints:
                    consider(child, pos + _common_prefix(child.tokens, rest))
        return best

    # --- eviction -----------------------------------------------------------------------
    def evictable(self) -> int:
        return sum(1 for n in self._nodes() if n.ref == 0 and not n.children)

    def evict(self, n_pages: int) -> int:
        """Free up to n_pages of unreferenced leaves, least recently used first. Returns the
        number freed. Evicting a leaf can make its parent an evictable leaf in turn."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if n.ref == 0 and not n.children]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens]
            freed.append(node.page)
            node.parent = None
            for ckpt in node.checkpoints.values():
                self.release_checkpoint(ckpt)
            node.checkpoints.clear()
            if parent is not self.root and parent.ref == 0 and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.n_pages -= len(freed)
        self.version += 1
        self.allocator.free(freed)
        return len(freed)

    def reset(self) -> int:
        """Evict everything unreferenced (e.g. when the engine is asked to drop its cache)."""
        return self.evict(self.n_pages)

    # --- invariants ---------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def pages(self) -> list[int]:
        return [n.page for n in self._nodes()]

    def check_integrity(self) -> None:
        s = self.page_size
        seen: set[int] = set()
        count = 0
        for n in self._nodes():
            count += 1
            assert n.parent is not None and n.parent.children.get(n.tokens) is n, (
                "broken parent link"
            )
            assert 0 < len(n.tokens) <= s, f"node holds {len(n.tokens)} tokens (page size {s})"
            assert len(n.tokens) == s or not n.children, "a partial page has children"
            assert n.ref >= 0, "negative reference count"
            assert n.page not in seen, f"page {n.page} held by two nodes"
            assert n.depth == (n.parent.depth + 1 if n.parent is not self.root else 0), "depth"
            lo = n.depth * s
            for b, ckpt in n.checkpoints.items():
                assert lo < b <= lo + len(n.tokens), f"checkpoint at {b} outside its node"
                assert ckpt.owner is n and ckpt.boundary == b, "checkpoint not owned by its node"
            seen.add(n.page)
        assert count == self.n_pages, f"tree counts {self.n_pages} pages, holds {count}"
        assert not (seen & self.allocator.free_set()), "a cached page is also on the free list"


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
