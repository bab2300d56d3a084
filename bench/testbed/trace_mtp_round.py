"""Where deltaspec's and the torch reference's MTP chain rounds first part on one testbed prompt,
and the torch MTP head's top-2 logits there (a gap near 0 is a near-tie of two implementations).

    python bench/testbed/trace_mtp_round.py --dir TB --prompt 10 --k 1

Both sides decode the prompt greedily (they must give the same text: checked) and draft k MTP
tokens a round (draft_n_min = k, as acceptance.py's rows); deltaspec's accepted lengths per round
come from GenerationResult.stats.accepted_lengths, torch's from reference.simulate with a
proposer that records each round's drafts and the head's logits. Runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import acceptance  # noqa: E402
import ddtree  # noqa: E402
import reference  # noqa: E402


def torch_rounds(folder: Path, prompt: list[int], n_new: int, k: int, mask_id: int):
    """(text, [(text position, accepted, drafts, truth, [(top1, top2, id1, id2) per draft])])."""
    target, draft, dflash, mtp = acceptance.load_torch_models(folder, torch.device("cpu"))
    prompts = torch.tensor([prompt])
    cont = reference.continuation(target, prompts, n_new, 0.0, 0)
    n_gen = reference.generated_lengths(cont, prompts.shape[1], 0)
    drafters = reference.Drafters(target, cont, draft=draft, dflash=dflash, mtp=mtp, mask_id=mask_id)
    proposed = []

    def propose(rows, starts, rooms):
        drafts, logits = drafters._mtp_steps(rows, starts, rooms)
        for s, d, lg in zip(starts, drafts, logits):
            proposed.append((s, d, [(*torch.topk(x, 2).values.tolist(), *torch.topk(x, 2).indices.tolist())
                                    for x in lg]))
        return [ddtree.chain(d) for d in drafts]

    reference.simulate(cont, prompts.shape[1], n_gen, propose, k, k)
    text = cont[0].tolist()
    rounds = []
    for s, d, tops in proposed:
        truth = text[s + 1:s + 1 + len(d)]
        n = ddtree.walk(ddtree.chain(d), truth)
        rounds.append((s - len(prompt) + 1, n, d, truth, tops))
    return text[len(prompt):len(prompt) + n_gen[0]], rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path, help="the testbed (manifest.json, target.gguf, hf/)")
    ap.add_argument("--prompt", type=int, required=True, help="index of the held-out prompt")
    ap.add_argument("--k", type=int, default=1, help="MTP drafts per round")
    ap.add_argument("--n-new", type=int, default=256)
    args = ap.parse_args()
    import deltaspec

    training = json.loads((args.dir / "manifest.json").read_text())["training"]
    prompt = training["prompts"][args.prompt]
    text, rounds = torch_rounds(args.dir, prompt, args.n_new, args.k, training["mask_token_id"])
    with deltaspec.Model(args.dir / "target.gguf", n_ctx=len(prompt) + args.n_new + 64, n_threads=1,
                         progress=False) as model:
        r = model.generate(prompt, max_tokens=args.n_new, temperature=0, spec_type="mtp", draft_n_max=args.k,
                           draft_n_min=args.k)
    if r.tokens != text[:len(r.tokens)]:
        raise SystemExit(f"prompt {args.prompt}: deltaspec's and torch's greedy texts differ; rounds are not comparable")
    ours = r.stats.accepted_lengths
    print(f"prompt {args.prompt}, k {args.k}: rounds with drafts: torch {len(rounds)}, deltaspec {len(ours)}")
    for i, (pos, n, drafts, truth, tops) in enumerate(rounds):
        if i < len(ours) and ours[i] == n:
            continue
        print(f"first differing round {i} (text position {pos}): torch accepted {n}, "
              f"deltaspec {ours[i] if i < len(ours) else None}; torch drafts {drafts}, text {truth}")
        for j, (v1, v2, t1, t2) in enumerate(tops):
            print(f"  draft {j}: torch head's top-2 logits {v1:.5f} (id {t1}), {v2:.5f} (id {t2}): gap {v1 - v2:.5f}")
        return
    print("every round the same")


if __name__ == "__main__":
    main()
