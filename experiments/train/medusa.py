"""Train Medusa-1 heads on precomputed target features (self-distillation data). A Hydra app
(conf/medusa.yaml): ``main`` is a thin wrapper around ``run(cfg)``.

    python -m experiments.train.medusa data=~/.cache/specdec/distill/smollm2-feat out=runs/medusa \
        heads=4 epochs=3 export=checkpoints/smollm2-135m-instruct-medusa     # EAGLE's data (eagle.py's docstring)
    python -m experiments.train.medusa ... resume=true        # continues from runs/medusa/ckpt.pt

What is trained. Head i (a ResBlock ``x + SiLU(W x + b)``, W zero-initialised as in Medusa, so a fresh
head is the target's LM head) reads the target's last hidden state h_t (after the final norm) and is
trained with cross-entropy against the token t+i+2 (the target's LM head on h_t gives t+1). The LM head
is the target's own, frozen (Medusa-1 trains it too; here it stays shared so a head is ~0.7 MB in bf16
and the step stays cheap). Loss = sum_i 0.8^i L_i (Medusa's weighting), L_i = (1 - soft) x CE against
the token + soft x CE against the target's own distribution at that token's position (self-distillation,
as Medusa's recipe does for data the target did not write; here it mainly regularises, see LOG.md).

Why it is feasible on a 2-core CPU. Nothing runs the target: gen_distill_data.py stored h_t for every
token. Medusa is per position, so positions are shuffled freely, and the softmax runs over a reduced
vocabulary (``vocab``: the most frequent tokens of the target's responses); labels outside it are left
out of the loss. The exported heads draft from that same vocabulary (``token_map`` in vLLM's Medusa
layout), which also makes drafting 6x cheaper than scoring SmolLM2's 49,152 tokens with every head.
Only response tokens are labels (the prompt is not the target's own text).

Export: ``specdec/heads/medusa.py``'s layout (bf16 ResBlocks, ``original_lm_head: true``, token_map) plus
``topk_accuracy`` [H][10] = P(the label is exactly the head's rank-r token) on held-out sequences, from
which MedusaProposer builds its static tree, and a README card. The exported heads are the best of the
validations run every ``eval_every`` steps (weighted top-1 over the heads: early stopping). Progress bars
(tqdm), W&B offline under ``out`` (a W&B failure only warns), a checkpoint every ``ckpt_every`` steps and at
the end. Data loading, the reduced vocabulary, the schedule, checkpoint I/O and logging are
experiments/train/common.py's.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm.auto import tqdm

from experiments.train.common import (TrainLogger, cosine_lr, load_data, options, read_checkpoint, save_atomic,
                                      vocab_by_frequency)
from specdec.heads.medusa import MedusaConfig, MedusaHeads, write_medusa

TOPK_ACC = 10  # ranks per head whose accuracy the export records (Medusa's trees use <= 10)


# ---------------------------------------------------------------------------------------------- data


def load_sequences(data_dir: Path, max_seqs: int | None = None) -> list[dict]:
    """tokens [n] int64, n_prompt, hidden [n-1, D] fp16 per sequence (common.load_data: the last layer only)."""
    seqs = load_data(data_dir, need_aux=False, max_seqs=max_seqs)
    if not seqs:
        raise ValueError(f"{data_dir}: no sequences in manifest.json's shards; run experiments.distill.prefill first")
    return seqs


def positions(seqs: list[dict], heads: int, to_reduced: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training examples over the sequences' hidden rows:

    - X [R, D] fp16: every hidden row, sequence after sequence (row t of a sequence = the state after
      its token t);
    - rows [P] int64: the example positions, those whose head-0 label (token t+2) is a response token;
    - Y [P, H] int64: Y[p, i] = the reduced id of token t+i+2, -1 when it is outside the reduced
      vocabulary (a miss, no hard loss), -2 past the sequence's end (no label at all);
    - teacher [P, H] int64: the row t+i+1 whose LM-head distribution predicted token t+i+2 (the soft
      target), -1 past the end."""
    xs, rows, ys, teach, off = [], [], [], [], 0
    for s in seqs:
        toks, n_p, hid = s["tokens"], s["n_prompt"], s["hidden"]
        n = len(toks)
        t = torch.arange(n - 1)
        keep = (t + 2 >= n_p) & (t + 2 < n)  # head 0's label is in the response
        t = t[keep]
        y = torch.full((len(t), heads), -2, dtype=torch.long)
        te = torch.full((len(t), heads), -1, dtype=torch.long)
        for i in range(heads):
            j = t + i + 2
            ok = j < n
            y[ok, i] = to_reduced[toks[j[ok]]]
            te[ok, i] = off + j[ok] - 1
        xs.append(hid)
        rows.append(off + t)
        ys.append(y)
        teach.append(te)
        off += n - 1
    return torch.cat(xs), torch.cat(rows), torch.cat(ys), torch.cat(teach)


# ---------------------------------------------------------------------------------------------- model


def target_lm_head(model: str) -> tuple[torch.Tensor, int, int]:
    """(the target's LM head weight [V, D] fp32, hidden size, vocab size) through the engine interface."""
    from specdec.engine.loader import load_engine

    eng = load_engine(model, num_slots=1, max_model_len=8)
    eye = torch.eye(eng.hidden_size, dtype=eng.dtype)
    return eng.compute_logits(eye).T.float().contiguous(), eng.hidden_size, eng.vocab_size


def losses(heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor, w_r: torch.Tensor,
           teacher: torch.Tensor | None = None, soft: float = 0.0) -> torch.Tensor:
    """[H] per-head loss: (1 - soft) x cross-entropy against the label token + soft x cross-entropy against
    the target's own distribution at the label's position (``teacher`` [N, H, D], its hidden states
    there; zero rows past the end), both over the reduced vocabulary; 0 for a head without labels."""
    logits = heads.logits(x, target_lm=w_r)  # [H, N, Vr]
    out = []
    for i in range(logits.shape[0]):
        lp = torch.log_softmax(logits[i], -1)
        valid = y[:, i] >= 0
        hard = F.nll_loss(lp[valid], y[valid, i]) if valid.any() else lp.new_zeros(())
        if soft and teacher is not None:
            has = y[:, i] != -2
            with torch.no_grad():
                p = torch.softmax(teacher[has, i] @ w_r.T, -1)  # [n, Vr] the target's law, reduced vocab
            soft_ce = -(p * lp[has]).sum(-1).mean() if has.any() else lp.new_zeros(())
            out.append((1 - soft) * hard + soft * soft_ce)
        else:
            out.append(hard)
    return torch.stack(out)


@torch.no_grad()
def evaluate(heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor, w_r: torch.Tensor, batch: int = 1024) -> dict:
    """Validation CE, top-1 accuracy and rank-r hit rates [H][TOPK_ACC] (labels out of vocab = misses)."""
    H = heads.cfg.num_heads
    ce, n_ce = torch.zeros(H), torch.zeros(H)
    hits, n = torch.zeros(H, TOPK_ACC), torch.zeros(H)
    for s in range(0, len(x), batch):
        xb, yb = x[s:s + batch].float(), y[s:s + batch]
        logits = heads.logits(xb, target_lm=w_r)  # [H, b, Vr]
        top = logits.topk(TOPK_ACC, -1).indices  # [H, b, R]
        for i in range(H):
            has = yb[:, i] != -2  # positions with a label inside the sequence
            valid = yb[:, i] >= 0
            if valid.any():
                ce[i] += F.cross_entropy(logits[i][valid], yb[valid, i], reduction="sum")
                n_ce[i] += valid.sum()
            hits[i] += (top[i][valid] == yb[valid, i, None]).float().sum(0)
            n[i] += has.sum()
    acc = hits / n.clamp(min=1)[:, None]
    return {"val_ce": (ce / n_ce.clamp(min=1)).tolist(), "val_top1": acc[:, 0].tolist(), "rank_acc": acc.tolist()}


# ---------------------------------------------------------------------------------------------- main


def run(cfg) -> dict:
    """Train (and export) as conf/medusa.yaml's keys say; ``cfg`` is a DictConfig (``common.compose("medusa",
    [...])``) or a plain mapping of every key. Returns the run's summary."""
    args = options(cfg, "medusa")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    seqs = load_sequences(Path(args.data).expanduser(), args.max_seqs)
    lm, D, V = target_lm_head(args.model)
    if seqs[0]["hidden"].shape[1] != D:
        raise ValueError(f"{args.data}: hidden states are {seqs[0]['hidden'].shape[1]} wide but {args.model} has "
                         f"hidden_size={D}; the data was made with another target")
    Vr = min(args.vocab or V, V)
    ids = vocab_by_frequency(seqs, V)[:Vr].sort().values  # [Vr] target id of each reduced id
    to_reduced = torch.full((V,), -1, dtype=torch.long)
    to_reduced[ids] = torch.arange(Vr)
    w_r = lm[ids].contiguous()  # [Vr, D] frozen
    rng = random.Random(args.seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_val = max(1, int(len(seqs) * args.val_frac)) if len(seqs) > 1 else 0
    val_seqs, train_seqs = [seqs[i] for i in order[:n_val]], [seqs[i] for i in order[n_val:]]
    x_tr, r_tr, y_tr, t_tr = positions(train_seqs, args.heads, to_reduced)
    x_va, r_va, y_va, _ = positions(val_seqs or train_seqs[:1], args.heads, to_reduced)
    x_va = x_va[r_va]
    in_vocab = (y_tr[:, 0] >= 0).float().mean().item()
    print(f"{len(train_seqs)} train / {len(val_seqs)} val sequences, {len(r_tr)} / {len(x_va)} positions, "
          f"vocab {Vr} of {V} (covers {in_vocab:.1%} of head-0 labels), D={D}", flush=True)

    cfg = MedusaConfig(num_heads=args.heads, num_layers=args.layers, hidden_size=D, vocab_size=V,
                       own_lm_head=False, draft_vocab_size=Vr if Vr < V else None)
    heads = MedusaHeads(cfg)
    with torch.no_grad():  # Medusa's init: W = 0, so each head starts as the LM head
        for blk in heads.heads:
            for rb in blk:
                rb.linear.weight.zero_()
                rb.linear.bias.zero_()
    if cfg.draft_vocab_size:
        heads.token_map.copy_(ids)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = math.ceil(len(r_tr) / args.batch)
    total = args.steps or max(1, int(args.epochs * steps_per_epoch))
    weights = torch.tensor([args.decay ** i for i in range(args.heads)])

    def lr_at(step: int) -> float:
        return cosine_lr(step, args.lr, args.warmup, total)

    step, elapsed_before, gen = 0, 0.0, torch.Generator().manual_seed(args.seed)
    best = {"score": -1.0, "step": 0, "state": None}  # validation: weighted top-1 over the heads
    ckpt = out / "ckpt.pt"
    if args.resume and ckpt.is_file():
        st = read_checkpoint(ckpt)
        heads.load_state_dict(st["heads"])
        opt.load_state_dict(st["opt"])
        step, elapsed_before = st["step"], st.get("elapsed", 0.0)
        gen.set_state(st["gen"])
        best = st.get("best", best)
        print(f"resumed from {ckpt} at step {step}", flush=True)
    wb = TrainLogger(out, {**vars(args), "method": "medusa", "vocab_used": Vr, "positions": len(r_tr)}, "medusa",
                     enabled=not args.no_wandb)
    log = (out / "log.jsonl").open("a")
    t0 = time.perf_counter()

    def save() -> None:
        save_atomic({"heads": heads.state_dict(), "opt": opt.state_dict(), "step": step, "gen": gen.get_state(),
                     "elapsed": elapsed_before + time.perf_counter() - t0, "args": vars(args), "best": best}, ckpt)

    def validate() -> None:
        heads.eval()
        ev = evaluate(heads, x_va, y_va, w_r)
        heads.train()
        score = float((weights * torch.tensor(ev["val_top1"])).sum() / weights.sum())
        wb.log({"val_score": score, **{f"val_top1_head{i}": v for i, v in enumerate(ev["val_top1"])}}, step)
        log.write(json.dumps({"step": step, "val_score": score, "val_top1": ev["val_top1"]}) + "\n")
        if score > best["score"]:
            best.update(score=score, step=step, state={k: v.clone() for k, v in heads.state_dict().items()})

    perm, cursor = torch.randperm(len(r_tr), generator=gen), 0
    bar = tqdm(total=total, initial=step, desc="medusa", mininterval=5)
    heads.train()
    while step < total:
        if cursor >= len(perm):
            perm, cursor = torch.randperm(len(r_tr), generator=gen), 0
        idx = perm[cursor:cursor + args.batch]
        cursor += args.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        teacher = x_tr[t_tr[idx].clamp(min=0)].float() if args.soft else None  # [b, H, D]
        per_head = losses(heads, x_tr[r_tr[idx]].float(), y_tr[idx], w_r, teacher, args.soft)
        loss = (weights * per_head).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        if step % args.log_every == 0 or step == total:
            rec = {"step": step, "loss": loss.item(), "lr": lr_at(step - 1),
                   **{f"ce_head{i}": v for i, v in enumerate(per_head.tolist())}}
            bar.set_postfix_str(f"loss {rec['loss']:.3f}")
            log.write(json.dumps(rec) + "\n")
            log.flush()
            wb.log(rec, step)
        if step % args.eval_every == 0 or step == total:
            validate()
        if step % args.ckpt_every == 0 and step < total:
            save()
    bar.close()
    if best["state"] is None:  # resumed from a checkpoint of a finished run that validated nothing
        validate()
    save()
    heads.load_state_dict(best["state"])  # early stopping: the best validated heads
    heads.eval()
    ev = evaluate(heads, x_va, y_va, w_r)
    elapsed = elapsed_before + time.perf_counter() - t0
    summary = {"steps": step, "best_step": best["step"], "train_seconds": round(elapsed, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
               "train_positions": len(r_tr), "val_positions": len(x_va), "vocab": Vr, "vocab_coverage": round(in_vocab, 4),
               "val_ce": [round(v, 4) for v in ev["val_ce"]], "val_top1": [round(v, 4) for v in ev["val_top1"]]}
    print(json.dumps(summary), flush=True)
    log.write(json.dumps({"final": summary}) + "\n")
    log.close()
    wb.log({f"val_top1_head{i}": v for i, v in enumerate(ev["val_top1"])}, step)
    wb.finish()
    if args.export:
        export(heads, cfg, ev, args, summary, len(train_seqs))
    return summary


def export(heads: MedusaHeads, cfg: MedusaConfig, ev: dict, args, summary: dict, n_seqs: int) -> Path:
    import msgspec

    acc = [[round(max(a, 1e-4), 5) for a in row] for row in ev["rank_acc"]]
    cfg = msgspec.structs.replace(cfg, topk_accuracy=acc)
    sd = {k: v for k, v in heads.state_dict().items()}
    p = write_medusa(args.export, cfg, sd, base_model_name_or_path=args.model)
    card = f"""# Medusa heads for {args.model}

Trained by `experiments/train/medusa.py` (issue 4): {cfg.num_heads} heads x {cfg.num_layers} ResBlock, the
target's own LM head (frozen, not stored: `original_lm_head: true`), drafting from the
{summary['vocab']} most frequent response tokens (`token_map`, {summary['vocab_coverage']:.1%} of labels).

- data: `experiments/train/gen_distill_data.py` self-distillation ({n_seqs} training sequences, GSM8K train,
  Self-Instruct seeds and generated prompts; no Spec-Bench), {summary['train_positions']} positions
- steps: {summary['steps']} x {args.batch} positions, AdamW lr {args.lr}, cosine, soft-target weight {args.soft};
  {summary['train_seconds']} s on the 2-core CPU (shared with other jobs)
- held-out top-1 accuracy per head: {summary['val_top1']}
- command: `python -m experiments.train.medusa data=<distill dir> out=<run> heads={cfg.num_heads}
  layers={cfg.num_layers} vocab={summary['vocab']} steps={summary['steps']} batch={args.batch} lr={args.lr}
  soft={args.soft} seed={args.seed} export=<this dir>` (exported: the best validation, step {summary['best_step']})
- measured tau: see experiments/LOG.md (Medusa section)
"""
    (p / "README.md").write_text(card)
    print(f"exported {p}", flush=True)
    return p


@hydra.main(version_base="1.3", config_path="conf", config_name="medusa")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
