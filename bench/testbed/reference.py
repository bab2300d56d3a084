"""The torch reference: acceptance of every drafter measured against the target's own output.

Why this is exact without running a verify pass per round: with greedy verification, and with
exact-match verification at T > 0 (the DFlash/DDTree reference rule, algorithms_brief.md §5.2),
the committed text is the target's own continuation (greedy, or one sample of it), whatever the
drafter proposed; the drafter only decides how much of it each target pass commits. So each row's
continuation is generated once (`continuation`), and a round starting after committed index
`start` accepts the longest path of the draft tree that matches continuation[start+1:]
(`ddtree.walk`). The drafters see only committed tokens and the target's features of committed
positions, which a causal target computes the same in the continuation's forward as in the verify
passes. Numerics can differ from an incremental run near ties; that is what the deltaspec
comparison (same drafter, greedy) measures.

All rows of a batch run in lock-step rounds, each at its own position; the drafters run on the
whole (right-padded) row each time, without KV caches, which keeps them independent of
transformers' cache API at the price of recomputation (small models: seconds on a GPU, minutes on
a CPU). The continuation, which would cost O(n^2) that way, goes through the target's cache and is
tested against recomputing (`continuation_recomputed`).
"""

from __future__ import annotations

import heapq
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

import ddtree
from heads import dflash_blocks, mtp_forward, target_features


@torch.no_grad()
def continuation(target, prompts: torch.Tensor, n_new: int, temperature: float, seed: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + n_new]: greedy (temperature 0) or plain sampling at `temperature`
    (no top-k / top-p), one token a step through the model's cache (KV rows and DeltaNet states:
    the same tokens as recomputing every row each step, checked by tests/test_testbed.py, and
    O(n) instead of O(n^2) on a CPU)."""
    # the cache's keyword: `cache` in transformers >= 5.2x, `past_key_values` before
    kw = "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"
    gen = torch.Generator(device=prompts.device).manual_seed(seed)
    out = target(input_ids=prompts, use_cache=True)
    ids = prompts
    for step in range(n_new):
        nxt = _next_tokens(out.logits[:, -1].float(), temperature, gen)
        ids = torch.cat([ids, nxt[:, None]], 1)
        if step + 1 < n_new:
            out = target(input_ids=nxt[:, None], use_cache=True, **{kw: getattr(out, kw)})
    return ids


def continuation_recomputed(target, prompts: torch.Tensor, n_new: int, temperature: float, seed: int) -> torch.Tensor:
    """continuation() recomputing the whole row each step, without a cache: what it must equal."""
    gen = torch.Generator(device=prompts.device).manual_seed(seed)
    ids = prompts
    for _ in range(n_new):
        nxt = _next_tokens(target(input_ids=ids).logits[:, -1].float(), temperature, gen)
        ids = torch.cat([ids, nxt[:, None]], 1)
    return ids


def _next_tokens(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Each row's next token: its argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]


def generated_lengths(cont: torch.Tensor, prompt_len: int, eos_id: int) -> list[int]:
    """Tokens generated per row, up to and including the first EOS (where generation stops)."""
    out = []
    for row in cont[:, prompt_len:].tolist():
        out.append(row.index(eos_id) + 1 if eos_id in row else len(row))
    return out


@dataclass
class Acceptance:
    steps: int = 0       # target passes after the prompt
    drafted: int = 0
    accepted: int = 0
    per_row_steps: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def simulate(cont: torch.Tensor, prompt_len: int, n_gen: list[int], propose, max_len: int,
             min_len: int = 1) -> Acceptance:
    """Rounds of draft + verify over every row until each has its n_gen tokens.

    propose(rows, starts, rooms) -> one ddtree.Tree per row: the draft after committed index
    starts[i], at most rooms[i] deep. A row drafts at most max_len tokens and at most what is
    left to generate minus the target's own token; when that room is below min_len it takes a
    plain step (no draft), as deltaspec does with draft_n_min."""
    B = cont.shape[0]
    produced = [1] * B          # the first token comes from the prefill
    acc = Acceptance(per_row_steps=[0] * B)
    cont_list = cont.tolist()
    while True:
        rows = [b for b in range(B) if produced[b] < n_gen[b]]
        if not rows:
            return acc
        rooms = [min(max_len, n_gen[b] - produced[b] - 1) for b in rows]
        drafting = [(b, r) for b, r in zip(rows, rooms) if r >= max(min_len, 1)]
        trees = {}
        if drafting:
            d_rows = [b for b, _ in drafting]
            starts = [prompt_len + produced[b] - 1 for b in d_rows]
            for b, tree in zip(d_rows, propose(d_rows, starts, [r for _, r in drafting])):
                trees[b] = tree
        for b in rows:
            acc.steps += 1
            acc.per_row_steps[b] += 1
            n = 0
            if b in trees:
                tree = trees[b]
                acc.drafted += len(tree.tokens)  # nodes the target verifies (a chain: its length)
                start = prompt_len + produced[b] - 1
                n = ddtree.walk(tree, cont_list[b][start + 1:start + 1 + max(tree.depths, default=0)])
            acc.accepted += n
            produced[b] += n + 1


def _right_pad(seqs: list[list[int]], pad: int, device) -> torch.Tensor:
    n = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (n - len(s)) for s in seqs], dtype=torch.long, device=device)


def best_first_tree(budget: int, max_depth: int):
    """deltaspec's build_best_first (csrc/draft_tree.cpp) with the top-1 chain seeded, as a generator:
    it yields the path (tokens below the root) of each node it expands and is sent that node's
    candidates (ids, log-probabilities), sorted by descending probability; returns the ddtree.Tree.
    A node is expanded when it is added below max_depth with room left in the budget; a node's
    children are its candidates best-first by path score (ties: the one offered first)."""
    tree = ddtree.Tree()
    if budget <= 0 or max_depth <= 0:
        return tree
    cands: dict[int, tuple[list[int], list[float]]] = {}
    score: dict[int, float] = {-1: 0.0}
    frontier: list = []
    seq = 0

    def path(node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(tree.tokens[node])
            node = tree.parents[node]
        return out[::-1]

    def offer(par: int, rank: int) -> None:
        nonlocal seq
        ids, lps = cands.get(par, ([], []))
        if rank < len(ids):
            heapq.heappush(frontier, (-(score[par] + lps[rank]), seq, par, rank))
            seq += 1

    def add(par: int, rank: int):
        ids, lps = cands[par]
        depth = 1 if par < 0 else tree.depths[par] + 1
        n = tree.add(int(ids[rank]), depth, par, score[par] + lps[rank])
        score[n] = score[par] + lps[rank]
        if depth < max_depth and len(tree.tokens) < budget:
            got = yield path(n)
            cands[n] = (got[0][:budget], got[1][:budget])
        return n

    got = yield []
    cands[-1] = (got[0][:budget], got[1][:budget])
    node = -1
    while len(tree.tokens) < min(budget, max_depth) and cands.get(node, ([], []))[0]:
        offer(node, 1)
        node = yield from add(node, 0)
    if tree.tokens:
        offer(len(tree.tokens) - 1, 0)
    while len(tree.tokens) < budget and frontier:
        _, _, par, rank = heapq.heappop(frontier)
        offer(par, rank + 1)
        n = yield from add(par, rank)
        offer(n, 0)
    return tree


class Drafters:
    """Draft proposers over one continuation batch: each method returns a `propose` for simulate."""

    def __init__(self, target, cont: torch.Tensor, draft=None, dflash=None, mtp=None, mask_id: int | None = None):
        self.target, self.cont, self.draft, self.dflash, self.mtp, self.mask_id = target, cont, draft, dflash, mtp, mask_id
        self.cont_list = cont.tolist()
        with torch.no_grad():
            layer_ids = list(dflash.target_layer_ids) if dflash is not None else [0]
            _, self.hidden, self.features = target_features(target, cont, layer_ids)

    @torch.no_grad()
    def _draft_last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """[len(seqs), V]: the draft model's logits after each token list (right-padded into one
        batch; the output head runs on each row's last real position only)."""
        ids = _right_pad(seqs, 0, self.cont.device)
        hidden = self.draft.model(input_ids=ids).last_hidden_state
        at = torch.tensor([len(q) - 1 for q in seqs], device=ids.device)
        return self.draft.lm_head(hidden[torch.arange(len(seqs), device=ids.device), at]).float()

    @torch.no_grad()
    def draft_model_chain(self, k: int):
        """The draft model's greedy chain of (up to) k tokens after the committed prefix."""
        def propose(rows, starts, rooms):
            seqs = [self.cont_list[b][:s + 1] for b, s in zip(rows, starts)]
            drafts = [[] for _ in rows]
            for step in range(max(rooms)):
                nxt = self._draft_last_logits(seqs).argmax(-1).tolist()
                for i, t in enumerate(nxt):
                    if step < rooms[i]:
                        drafts[i].append(t)
                        seqs[i] = seqs[i] + [t]
            return [ddtree.chain(d) for d in drafts]
        return propose

    @torch.no_grad()
    def draft_model_tree(self, budget: int, rank_top_k: int = 32):
        """The draft model's tree as deltaspec's ModelDrafter::propose_tree builds it: best-first over
        per-node distributions (every node added below the depth limit is expanded by the draft model
        reading its path), the top-1 chain seeded first (build_best_first's seed_chain), candidates
        ranked as deltaspec's tree ranking does (the top rank_top_k logits at temperature 1,
        renormalised). The rows' builders run in lockstep: one batched draft pass per expansion."""
        def propose(rows, starts, rooms):
            builders = [best_first_tree(budget, room) for room in rooms]
            trees: list = [None] * len(rows)
            wants = {}
            for i, b in enumerate(builders):
                try:
                    wants[i] = next(b)
                except StopIteration as done:
                    trees[i] = done.value
            while wants:
                order = list(wants)
                last = self._draft_last_logits([self.cont_list[rows[i]][:starts[i] + 1] + wants[i] for i in order])
                vals, toks = last.topk(min(rank_top_k, last.shape[-1]), -1)
                lps = torch.log_softmax(vals, -1)
                for j, i in enumerate(order):
                    try:
                        wants[i] = builders[i].send((toks[j].tolist(), lps[j].tolist()))
                    except StopIteration as done:
                        trees[i] = done.value
                        del wants[i]
            return trees
        return propose

    @torch.no_grad()
    def _dflash_logprobs(self, rows, starts) -> torch.Tensor:
        """[len(rows), block-1, V] log-probabilities of one DFlash block opened at each start."""
        idx = torch.tensor(rows, device=self.cont.device)
        anchors = torch.tensor(starts, device=self.cont.device)[:, None]
        anchor_tokens = self.cont[idx].gather(1, anchors)
        logits = dflash_blocks(self.dflash, self.target, self.features[idx], anchors, anchor_tokens, self.mask_id)
        return torch.log_softmax(logits[:, 0].float(), -1)

    def dflash_chain(self):
        def propose(rows, starts, rooms):
            top = self._dflash_logprobs(rows, starts).argmax(-1).tolist()
            return [ddtree.chain(t[:r]) for t, r in zip(top, rooms)]
        return propose

    def dflash_tree(self, budget: int):
        def propose(rows, starts, rooms):
            lp = self._dflash_logprobs(rows, starts)
            vals, toks = lp.topk(min(budget, lp.shape[-1]), -1)
            vals, toks = vals.cpu().numpy(), toks.cpu().numpy()
            return [ddtree.build(toks[i], vals[i], budget, max_depth=r) for i, r in enumerate(rooms)]
        return propose

    @torch.no_grad()
    def _mtp_steps(self, rows, starts, rooms):
        """The MTP head's greedy chain after each start, up to rooms[i] steps: (drafts, logits), logits[i]
        the head's logits before each of row i's drafts. Step 0 reads (committed token, target hidden
        before it) at the last committed position, with the head's attention over every committed
        (token, hidden) pair; step j > 0 reads (draft j, the head's own output hidden of step j-1), as
        llama.cpp drives it."""
        dev = self.cont.device
        n = len(rows)
        # pair p (p = 1 .. start): token at p with the target's hidden at p-1
        toks = [self.cont_list[b][1:s + 1] for b, s in zip(rows, starts)]
        hid = [self.hidden[b, :s] for b, s in zip(rows, starts)]
        drafts, step_logits = [[] for _ in rows], [[] for _ in rows]
        for step in range(max(rooms)):
            T = max(len(t) for t in toks)
            ids = _right_pad(toks, 0, dev)
            h = torch.zeros(n, T, self.hidden.shape[-1], device=dev, dtype=self.hidden.dtype)
            for i in range(n):
                h[i, :hid[i].shape[0]] = hid[i]
            pos = torch.arange(1, T + 1, device=dev).expand(n, T)
            at = torch.tensor([len(t) - 1 for t in toks], device=dev)
            last, out_h = mtp_forward(self.mtp, self.target, ids, h, pos, at=at)
            nxt = last.argmax(-1).tolist()
            for i, t in enumerate(nxt):
                if step < rooms[i]:
                    drafts[i].append(t)
                    step_logits[i].append(last[i].float())
                    toks[i] = toks[i] + [t]
                    hid[i] = torch.cat([hid[i], out_h[i, at[i]][None]], 0)
        return drafts, step_logits

    def mtp_chain(self, k: int):
        """k MTP steps (see _mtp_steps): the greedy chain."""
        def propose(rows, starts, rooms):
            return [ddtree.chain(d) for d in self._mtp_steps(rows, starts, rooms)[0]]
        return propose

    def mtp_tree(self, budget: int, rank_top_k: int = 32):
        """An MTP draft tree as deltaspec's MtpDrafter::propose_tree builds it: the head's top-1 chain
        as deep as the room, then the best of the chain nodes' other candidates as leaves (the head
        runs only along the chain), best-first by path log-probability. Candidates are ranked as
        deltaspec's tree ranking does: the top rank_top_k logits at temperature 1, renormalised."""
        def propose(rows, starts, rooms):
            trees = []
            for chain, logits in zip(*self._mtp_steps(rows, starts, rooms)):
                D = min(len(chain), budget)
                lps = []
                for lg in logits[:D]:
                    v, t = lg.topk(min(rank_top_k, lg.shape[-1]))
                    lps.append((torch.log_softmax(v, -1).tolist(), t.tolist()))
                tree = ddtree.chain(chain[:D])
                prefix = [0.0]  # path score of the chain node at each depth (0: the root)
                for d in range(D):
                    prefix.append(prefix[-1] + lps[d][0][0])
                # siblings of the chain node at depth d + 1: rank r >= 1 of step d's candidates
                # (their score is non-increasing in r, so a heap over next ranks is best-first)
                heap = [(-(prefix[d] + lps[d][0][1]), d, 1) for d in range(D) if len(lps[d][0]) > 1]
                heapq.heapify(heap)
                while heap and len(tree.tokens) < budget:
                    neg, d, r = heapq.heappop(heap)
                    tree.add(int(lps[d][1][r]), d + 1, d - 1, -neg)  # parent: chain node d - 1 (-1: root)
                    if r + 1 < len(lps[d][0]):
                        heapq.heappush(heap, (-(prefix[d] + lps[d][0][r + 1]), d, r + 1))
                trees.append(tree)
            return trees
        return propose
