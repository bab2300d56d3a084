"""DDTree (Ringel & Romano, arXiv 2604.12989; algorithms_brief.md §2): the best-first draft tree
built from one DFlash block's per-depth distributions, and the walk that verifies it.

Depth d (1-based) of the block has log-probabilities lp[d-1, :], treated as independent marginals;
a node's score is the sum of its path's log-probabilities. The tree holds the `budget` best nodes:
grown from a heap whose only frontier items are each emitted node's next sibling (same depth, next
rank, same parent) and first child (next depth, rank 0), so nodes come out in non-increasing score.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)    # node i's token
    depths: list[int] = field(default_factory=list)    # 1 .. D
    parents: list[int] = field(default_factory=list)   # -1: the root (the last committed token)
    scores: list[float] = field(default_factory=list)
    children: dict[int, dict[int, int]] = field(default_factory=dict)  # node (-1 root) -> token -> node

    def add(self, token: int, depth: int, parent: int, score: float) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.depths.append(depth)
        self.parents.append(parent)
        self.scores.append(score)
        self.children.setdefault(parent, {})[token] = i
        return i


def chain(tokens) -> Tree:
    """A linear draft as a tree (each node the child of the one before)."""
    t = Tree()
    parent = -1
    for d, tok in enumerate(tokens, 1):
        parent = t.add(int(tok), d, parent, 0.0)
    return t


def build(top_tokens: np.ndarray, top_logprobs: np.ndarray, budget: int, max_depth: int | None = None) -> Tree:
    """The best-first tree of `budget` nodes.

    top_tokens, top_logprobs: [D, K], each row sorted by descending log-probability (the top-K of
    each depth's distribution, K >= min(budget, V) so no node the budget could reach is missing);
    max_depth cuts the tree shallower than D (the end of a generation)."""
    D, K = top_tokens.shape
    D = D if max_depth is None else min(D, max_depth)
    tree = Tree()
    if budget <= 0 or D <= 0:
        return tree
    # heap items: (-score, tie-break counter, depth, rank, parent node)
    heap = [(-float(top_logprobs[0, 0]), 0, 1, 0, -1)]
    counter = 1
    while heap and len(tree.tokens) < budget:
        neg, _, depth, rank, parent = heapq.heappop(heap)
        score = -neg
        node = tree.add(int(top_tokens[depth - 1, rank]), depth, parent, score)
        if rank + 1 < K:
            sib = score - float(top_logprobs[depth - 1, rank]) + float(top_logprobs[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, counter, depth, rank + 1, parent))
            counter += 1
        if depth < D:
            heapq.heappush(heap, (-(score + float(top_logprobs[depth, 0])), counter, depth + 1, 0, node))
            counter += 1
    return tree


def walk(tree: Tree, verified) -> int:
    """How many drafted tokens are accepted: from the root, follow the child whose token is the
    target's token at that depth (its greedy choice or its sample), as long as there is one."""
    node, n = -1, 0
    for tok in verified:
        nxt = tree.children.get(node, {}).get(int(tok))
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n
