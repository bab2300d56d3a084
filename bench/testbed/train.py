"""Train the testbed: BPE on the corpus, the Qwen3.5 target, then three drafters against the frozen
target (a 2-layer same-family draft model, a DFlash block drafter, the MTP head), and save them as
Hugging Face folders (f16 safetensors) under OUT/hf/.

    python bench/testbed/train.py --out /tmp/testbed [--smoke] [--target-seconds S] [--drafter-seconds S]

Training is budgeted in wall-clock seconds (the learning rate follows the fraction of the budget
spent), so the same command fits the GPU machine's call limit whatever its speed. Every drafter
learns the target's next-token distribution (soft labels, i.e. distillation): what decides
acceptance is agreement with the target, and it stands in for the recipe's target-regenerated data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe  # noqa: E402
import corpus  # noqa: E402
import data  # noqa: E402
from heads import MTPHead, dflash_blocks, mtp_forward, target_features  # noqa: E402
from shapes import MASK_TEXT, SHAPES  # noqa: E402

DFLASH_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # loss decay per block size, as the DFlash paper sets it


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def lr_factor(frac: float, warmup: float = 0.04) -> float:
    """Linear warm-up, then cosine down to 10% of the peak, over the fraction of the time budget spent."""
    if frac < warmup:
        return frac / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warmup) / (1 - warmup))))


def soft_ce(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's distribution, per position ([...] shape)."""
    return -(F.softmax(teacher_logits.float(), -1) * F.log_softmax(student_logits.float(), -1)).sum(-1)


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def build_models(sh, mask_id: int, device):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config
    tcfg = Qwen3_5TextConfig(**sh.target_config())
    tcfg.architectures = ["Qwen3_5ForCausalLM"]
    dcfg = Qwen3_5TextConfig(**sh.draft_config())
    dcfg.architectures = ["Qwen3_5ForCausalLM"]
    fcfg = Qwen3Config(**sh.dflash_config(mask_id))
    for c in (tcfg, dcfg, fcfg):
        c._attn_implementation = "sdpa"
    target = Qwen3_5ForCausalLM(tcfg).to(device)
    draft = Qwen3_5ForCausalLM(dcfg).to(device)
    dflash = DFlashDraftModel(fcfg).to(device)
    mtp = MTPHead(tcfg).to(device)
    return target, draft, dflash, mtp


def progress(elapsed: float, budget_s: float, step: int, max_steps: int | None) -> float | None:
    """Fraction of the budget spent (None: done). A step budget, when given, replaces the time
    budget: the same model on any machine (tests); a time budget fits a call limit (the GPU run)."""
    frac = step / max_steps if max_steps else elapsed / budget_s
    return frac if frac < 1 else None


def train_target(target, win, budget_s, batch, device, peak_lr=3e-3, max_steps=None):
    opt = torch.optim.AdamW(target.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0, step, losses = time.time(), 0, []
    target.train()
    while (frac := progress(elapsed := time.time() - t0, budget_s, step, max_steps)) is not None:
        for g in opt.param_groups:
            g["lr"] = peak_lr * lr_factor(frac)
        x = win.batch(batch)
        with autocast(device):
            logits = target(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 100 == 0 or step == 1:
            log(f"target step {step} loss {np.mean(losses[-50:]):.3f} ({elapsed:.0f}/{budget_s:.0f} s)")
    target.eval()
    return {"steps": step, "seconds": round(time.time() - t0, 1), "train_loss": float(np.mean(losses[-50:])),
            "tokens": step * batch * win.seq_len}


def drafter_losses(target, draft, dflash, mtp, x, sh, mask_id, n_anchors, gen):
    """The three drafters' losses on one batch (the target's forward shared), and their top-1
    agreement with the target, for logging and evaluation."""
    B, S = x.shape
    L = sh.block_size
    with torch.no_grad():
        t_logits, t_hidden, feats = target_features(target, x, sh.dflash_target_layer_ids)
    t_top = t_logits.argmax(-1)
    out = {}
    # draft model: every position
    d_logits = draft(input_ids=x).logits
    out["draft"] = (soft_ce(t_logits, d_logits).mean(), (d_logits.argmax(-1) == t_top).float().mean())
    # MTP at p = 1..S-1 sees (x_p, target hidden at p-1) and predicts x_{p+1}, the target's guess at p
    pos = torch.arange(1, S, device=x.device).expand(B, -1)
    m_logits, _ = mtp_forward(mtp, target, x[:, 1:], t_hidden[:, :-1], pos)
    out["mtp"] = (soft_ce(t_logits[:, 1:], m_logits).mean(), (m_logits.argmax(-1) == t_top[:, 1:]).float().mean())
    # DFlash: random anchors 1 .. S-L; block slot k (1..L-1) predicts the token at anchor+k, whose
    # target distribution is the target's output at anchor+k-1
    anchors = torch.rand(B, S - L, generator=gen).argsort(1)[:, :n_anchors].sort(1).values.to(x.device) + 1
    b_logits = dflash_blocks(dflash, target, feats, anchors, x.gather(1, anchors), mask_id)
    idx = anchors[:, :, None] + torch.arange(L - 1, device=x.device)      # anchor+k-1 for k = 1..L-1
    teacher = t_logits.gather(1, idx.flatten(1)[:, :, None].expand(-1, -1, t_logits.shape[-1])).view(*b_logits.shape)
    w = torch.exp(-torch.arange(L - 1, device=x.device, dtype=torch.float32) / DFLASH_GAMMA.get(L, 7.0))
    per_slot = soft_ce(teacher, b_logits).mean((0, 1))
    agree = (b_logits.argmax(-1) == teacher.argmax(-1)).float().mean((0, 1))
    out["dflash"] = ((per_slot * w).sum() / w.sum(), agree[0])
    out["dflash_agree_per_slot"] = agree
    return out


def train_drafters(target, draft, dflash, mtp, win, sh, mask_id, budget_s, batch, device, seed, peak_lr=2e-3,
                   max_steps=None):
    for p in target.parameters():
        p.requires_grad_(False)
    mods = {"draft": draft, "dflash": dflash, "mtp": mtp}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
            for k, m in mods.items()}
    n_anchors = max(1, (sh.seq_len // sh.block_size) // 2)
    gen = torch.Generator().manual_seed(seed + 17)
    t0, step, hist = time.time(), 0, {k: [] for k in mods}
    for m in mods.values():
        m.train()
    while (frac := progress(elapsed := time.time() - t0, budget_s, step, max_steps)) is not None:
        for o in opts.values():
            for g in o.param_groups:
                g["lr"] = peak_lr * lr_factor(frac)
        x = win.batch(batch)
        with autocast(device):
            out = drafter_losses(target, draft, dflash, mtp, x, sh, mask_id, n_anchors, gen)
        for k, m in mods.items():
            opts[k].zero_grad(set_to_none=True)
        sum(out[k][0] for k in mods).backward()  # disjoint parameters: one backward serves all three
        for k, m in mods.items():
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[k].step()
            hist[k].append(out[k][0].item())
        step += 1
        if step % 100 == 0 or step == 1:
            log(f"drafters step {step} " + " ".join(f"{k} {np.mean(v[-50:]):.3f}" for k, v in hist.items())
                + f" ({elapsed:.0f}/{budget_s:.0f} s)")
    for m in mods.values():
        m.eval()
    return {"steps": step, "seconds": round(time.time() - t0, 1),
            "train_loss": {k: float(np.mean(v[-50:])) for k, v in hist.items()}}


@torch.no_grad()
def evaluate(target, draft, dflash, mtp, heldout, sh, mask_id, device, n_batches, batch, seed):
    """Held-out: target cross-entropy; each drafter's loss against the target and top-1 agreement."""
    gen = torch.Generator().manual_seed(seed + 99)
    win = data.Windows(heldout, sh.seq_len, device, seed + 5)
    acc = {"target_ce": [], "draft": [], "mtp": [], "dflash": [], "draft_agree": [], "mtp_agree": [],
           "dflash_agree_slot1": [], "dflash_agree_per_slot": []}
    for _ in range(n_batches):
        x = win.batch(batch)
        with autocast(device):
            logits = target(input_ids=x).logits
            out = drafter_losses(target, draft, dflash, mtp, x, sh, mask_id, max(1, sh.seq_len // sh.block_size // 2), gen)
        acc["target_ce"].append(F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten()).item())
        for k in ("draft", "mtp", "dflash"):
            acc[k].append(out[k][0].item())
        acc["draft_agree"].append(out["draft"][1].item())
        acc["mtp_agree"].append(out["mtp"][1].item())
        acc["dflash_agree_slot1"].append(out["dflash"][1].item())
        acc["dflash_agree_per_slot"].append(out["dflash_agree_per_slot"].float().cpu().numpy())
    res = {k: float(np.mean(v)) for k, v in acc.items() if k != "dflash_agree_per_slot"}
    res["dflash_agree_per_slot"] = [round(float(a), 4) for a in np.mean(acc["dflash_agree_per_slot"], 0)]
    return res


def save_hf(out: Path, tk, target, draft, dflash, mtp) -> None:
    """Three HF folders in f16 (what the GGUFs carry, so torch and the engine use the same weights)."""
    from safetensors.torch import save_file

    def half(sd, prefix=""):
        return {prefix + k: v.detach().to("cpu", torch.float16).contiguous() for k, v in sd.items()}

    for name, model in (("target", target), ("draft", draft)):
        folder = out / "hf" / name
        folder.mkdir(parents=True, exist_ok=True)
        sd = half(model.state_dict())
        sd.pop("lm_head.weight", None)  # tied to the embedding
        if name == "target":
            sd.update(half(mtp.state_dict(), "mtp."))
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("_attn_implementation_autoset", None)
        cfg["dtype"] = "float16"
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        bpe.write_hf_files(tk, folder)
    folder = out / "hf" / "dflash"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(half(dflash.state_dict()), str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = dflash.config.to_dict()
    cfg["dtype"] = "float16"
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a 1.5 MB corpus, seconds of CPU")
    ap.add_argument("--target-seconds", type=float, default=None)
    ap.add_argument("--drafter-seconds", type=float, default=None)
    ap.add_argument("--target-steps", type=int, default=None, help="a step budget in place of the time budget")
    ap.add_argument("--drafter-steps", type=int, default=None, help="a step budget in place of the time budget")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-seconds", type=float, default=None,
                    help="shrink both training budgets so that the whole script ends within this many seconds")
    ap.add_argument("--bpe-bytes", type=int, default=24_000_000, help="corpus bytes the BPE is trained on")
    args = ap.parse_args(argv)
    sh = SHAPES["smoke" if args.smoke else "full"]
    target_s = args.target_seconds if args.target_seconds is not None else (8 if args.smoke else 170)
    drafter_s = args.drafter_seconds if args.drafter_seconds is not None else (8 if args.smoke else 120)
    batch = args.batch or (4 if args.smoke else 32)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    t_main = time.time()
    times = {}

    t = time.time()
    files = corpus.collect(sh.max_corpus_bytes)
    train_files, held_files = corpus.split(files)
    times["corpus_s"] = round(time.time() - t, 1)
    log(f"corpus: {len(files)} files, train {len(train_files)} ({len({f.package for f in train_files})} packages), "
        f"held-out {len(held_files)} ({len({f.package for f in held_files})} packages)")

    t = time.time()
    budget, bpe_texts = 0, []
    for f in train_files:
        if budget >= args.bpe_bytes:
            break
        bpe_texts.append(f.text)
        budget += len(f.text)
    tk = bpe.train(bpe_texts, sh.vocab_size)
    mask_id = tk.token_to_id(MASK_TEXT)
    train_stream = data.encode_stream(tk, [f.text for f in train_files])
    held_stream = data.encode_stream(tk, [f.text for f in held_files])
    times["tokenizer_s"] = round(time.time() - t, 1)
    log(f"BPE {sh.vocab_size}: train {len(train_stream)} tokens, held-out {len(held_stream)} tokens "
        f"({times['tokenizer_s']} s)")
    # the acceptance report's prompts: fixed here, with the split, so every later run uses the same
    n_prompts, prompt_len, tail = (4, 32, 32) if args.smoke else (64, 128, 256)
    prompts = data.heldout_prompts(tk, [f.text for f in held_files], n_prompts, prompt_len, tail, args.seed)
    (args.out / "split.json").write_text(json.dumps({
        side: [{"package": f.package, "path": f.path, "sha256": hashlib.sha256(f.text.encode()).hexdigest()}
               for f in fs] for side, fs in (("train", train_files), ("heldout", held_files))}))

    if args.deadline_seconds is not None:  # corpus + BPE took what they took: training gives way
        left = args.deadline_seconds - (time.time() - t_main) - 30  # evaluation and saving
        scale = min(1.0, max(0.0, left) / (target_s + drafter_s))
        target_s, drafter_s = target_s * scale, drafter_s * scale
    target, draft, dflash, mtp = build_models(sh, mask_id, device)
    win = data.Windows(train_stream, sh.seq_len, device, args.seed)
    log(f"target {sum(p.numel() for p in target.parameters())} params on {device}, {target_s:.0f} s")
    target_stats = train_target(target, win, target_s, batch, device, max_steps=args.target_steps)
    log(f"drafters: draft {sum(p.numel() for p in draft.parameters())}, dflash "
        f"{sum(p.numel() for p in dflash.parameters())}, mtp {sum(p.numel() for p in mtp.parameters())} params, "
        f"{drafter_s:.0f} s")
    drafter_stats = train_drafters(target, draft, dflash, mtp, win, sh, mask_id, drafter_s, batch, device, args.seed,
                                   max_steps=args.drafter_steps)
    t = time.time()
    heldout = evaluate(target, draft, dflash, mtp, held_stream, sh, mask_id, device,
                       n_batches=2 if args.smoke else 16, batch=batch, seed=args.seed)
    times["eval_s"] = round(time.time() - t, 1)
    log("held-out: " + json.dumps({k: v for k, v in heldout.items() if k != "dflash_agree_per_slot"}))
    save_hf(args.out, tk, target, draft, dflash, mtp)
    summary = {
        "shapes": sh.name, "seed": args.seed, "device": str(device), "torch": torch.__version__,
        "corpus": {"files": len(files), "bytes": sum(len(f.text) for f in files),
                   "train_files": len(train_files), "heldout_files": len(held_files),
                   "train_packages": len({f.package for f in train_files}),
                   "heldout_packages": len({f.package for f in held_files}),
                   "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(held_stream)),
                   "roots": sorted({f.root for f in files})},
        "vocab_size": sh.vocab_size, "mask_token_id": mask_id, "block_size": sh.block_size,
        "prompts": prompts,
        "total_s": round(time.time() - t_main, 1), "target": target_stats, "drafters": drafter_stats, "heldout": heldout, "times": times,
    }
    (args.out / "training.json").write_text(json.dumps(summary, indent=1))
    log(f"saved {args.out / 'hf'}; target held-out CE {heldout['target_ce']:.3f} (train {target_stats['train_loss']:.3f})")
    return summary


if __name__ == "__main__":
    main()
