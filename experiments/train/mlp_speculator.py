"""Train IBM's MLP speculator (``specdec.heads.mlp_speculator.MLPSpeculator``, the network
``proposers/mlp_speculator.py`` loads) on precomputed target features (the distillation shards).

    python -m experiments.distill.prefill ... --out ~/.cache/specdec/distill/smollm2-feat     # once
    python -m experiments.train.mlp_speculator data=~/.cache/specdec/distill/smollm2-feat \
        out=runs/mlp-speculator epochs=2 export=checkpoints/smollm2-135m-instruct-mlp-speculator
    python -m experiments.train.mlp_speculator ... resume=true   # continues from runs/mlp-speculator/ckpt.pt

A Hydra app (conf/mlp_speculator.yaml): ``main`` is a thin wrapper around ``run(cfg)``.

What is trained. ``n_predict`` stages (default 3) with ``tie_weights=True`` and inner_dim = emb_dim = the
target's hidden size D. At a position t, stage 0 reads the target's state h_t (the data's hidden[t], after
the final norm) and the token the target just produced, tokens[t+1]; stage i >= 1 reads stage i-1's state
and tokens[t+1+i] (teacher forcing); stage i predicts tokens[t+2+i]. Each stage is ``MLPSpeculator.stage``
itself (state <- GELU(LN(proj_i(state) + emb_weight/state_weight * emb(token))), the proposer's maths),
called with the heads swapped out for identities (``states``): stage() would otherwise apply the full
49,152-row head to every position, and the loss reads the reduced vocabulary's rows only.

What is frozen. ``emb`` is the target's input embedding and ``head`` its LM head (both [V, D]; with
tie_weights one module each, shared by every stage), copied in and frozen (requires_grad off, left out of
the optimizer and of ckpt.pt), so the exported full-vocabulary head is the target's own and every token
can be drafted. Trained: proj.0 [D, D], proj.1 [D, D] (shared by stages >= 1) and the shared ln (scale,
shift): ~0.66M parameters for SmolLM2. Initialisation (``init=identity``, default): proj.0 =
diag(1 / per-dimension RMS of h) (the input scaling eagle.py applies to the same states), proj.1 = I,
LN scale 1, shift 0; ``init=random`` is IBM's N(0, 1/inner_dim). With the head frozen, a stage's logits
are the target's head applied to a GELU output (components >= -0.17) rather than to a target-like state;
that still carries the target's distributions: a free pre-activation per position, optimised against
SmolLM2's softmax(W h) on 98 positions of text (1,696 candidate tokens), reached KL 0.03 nats and 100%
top-1 agreement (0.01 nats without the GELU).

Loss, per stage i: cross-entropy against the target's own distribution at the predicted position,
p = softmax(W_r h[t+1+i]) (hidden[t+1+i] is the state that predicted tokens[t+2+i]), W_r = the head's rows
of the reduced vocabulary (``vocab``: the most frequent response tokens, as eagle.py), with the
speculator's logits computed on those rows only; positions whose label tokens[t+2+i] is outside the
reduced vocabulary are left out; response labels weigh 1, prompt labels ``prompt_weight`` (default 0:
left out). Stage weights ``stage_decay``^i, default 1.0 = IBM's plain sum over stages (fms-fsdp's
speculator training); 0.8 is Medusa's/EAGLE's.

Batches. The speculator reads one position and nothing before it, so examples are positions (like
medusa.py), shuffled across the whole training set: ``token_budget`` positions per batch, no
padding, and no prompt-only positions when prompt_weight is 0 (eagle.py's ``batches`` groups whole
sequences because its head attends over them). Data loading (memory-mapped shards), the reduced
vocabulary, the target's tables, checkpoint I/O and W&B come from experiments/train/common.py.

Reported: log.jsonl (every 20 steps; held-out figures at each epoch end and at the end), a tqdm bar, W&B
offline under ``out`` (a failure only warns), ckpt.pt every ``ckpt_every`` steps, at each epoch end and at the
end. The final held-out evaluation prints, per stage, the teacher-forced top-1 accuracy on response
labels over the reduced vocabulary (val/acc{i}; a label outside it counts as a miss) and over the full
vocabulary through the frozen head (val/acc_full{i}), and val/ceil{i}, the target's own top-1 over the
reduced vocabulary on the same labels (below 1 through labels outside that vocabulary and responses
sampled at T > 0). ``export=DIR`` writes config.json + model.safetensors (bf16) through
``write_mlp_speculator``, no card: by default target-tied (``target_tied=True``: proj and ln only, ~1.3 MB
for SmolLM2; config.json's ``specdec_target_tied: ["emb", "head"]`` has MLPSpeculatorProposer take them from
the target, of which they are frozen copies); ``export_full=true`` writes the complete IBM layout with the emb
and head (~113 MB for SmolLM2, too big to commit), which vLLM and fms-extras can load.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import hydra
import torch
import torch.nn as nn
from omegaconf import DictConfig
from tqdm.auto import tqdm

from experiments.train.common import (TrainLogger, cosine_lr, feature_scale, load_data, options, read_checkpoint,
                                      reduced_vocab, save_atomic, target_parts, vocab_by_frequency)
from specdec.heads.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig, write_mlp_speculator

LOG_EVERY = 20


# ---------------------------------------------------------------------------------------------- data


def target_tables(model: str) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(vocab size, hidden size, input embedding [V, D] fp32, LM head [V, D] fp32) of the target: from its
    safetensors (common's ``target_parts``), or the in-process tiny model's seeded weights."""
    from specdec.engine.loader import resolve_model_dir

    if resolve_model_dir(model) is None:  # tiny-random-llama: no files; the seed the loader uses (0)
        from specdec.engine.tiny import tiny_config, tiny_random_weights

        cfg = tiny_config()
        sd = tiny_random_weights(cfg, 0)
        emb = sd["model.embed_tokens.weight"].float()
        return cfg.vocab_size, cfg.hidden_size, emb, sd.get("lm_head.weight", emb).float()
    cfg, emb, _, lm = target_parts(model)
    return cfg.vocab_size, cfg.hidden_size, emb, lm


def examples(seqs: list[dict], n_predict: int, prompt_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index [P], position t [P]) of every training example: t has at least stage 0's label
    (t + 2 < n) and, when prompt labels weigh nothing, at least one stage's label in the response."""
    si, ts = [], []
    for k, s in enumerate(seqs):
        n, n_p = len(s["tokens"]), s["n_prompt"]
        lo = 0 if prompt_weight > 0 else max(0, n_p - 1 - n_predict)  # stage n-1's label t+1+n >= n_p
        t = torch.arange(lo, max(lo, n - 2))
        si.append(torch.full_like(t, k))
        ts.append(t)
    return torch.cat(si), torch.cat(ts)


def gather(seqs: list[dict], si: torch.Tensor, ts: torch.Tensor, n_predict: int) -> dict:
    """One batch of positions: h [P, n+1, D] fp32 (h[:, 0] = hidden[t], stage 0's input; h[:, 1+i] =
    hidden[t+1+i], the target's state that predicted stage i's label; zero past the end), tok [P, n+1]
    (tok[:, i] = tokens[t+1+i], stage i's input; tok[:, i+1] its label), has [P, n] (stage i's label
    exists), resp [P, n] (it is a response token)."""
    n = n_predict
    hs, toks, lens, resp = [], [], [], []
    for k, t in zip(si.tolist(), ts.tolist()):
        s = seqs[k]
        h = s["hidden"][t:t + n + 1]
        hs.append(h)
        lens.append(len(h))
        tk = s["tokens"][t + 1:t + n + 2]
        toks.append(tk)
        resp.append(t + 2 + torch.arange(n) >= s["n_prompt"])
    h = nn.utils.rnn.pad_sequence(hs, batch_first=True).float()
    if h.shape[1] < n + 1:
        h = torch.cat([h, h.new_zeros(h.shape[0], n + 1 - h.shape[1], h.shape[2])], 1)
    tok = nn.utils.rnn.pad_sequence(toks, batch_first=True)
    if tok.shape[1] < n + 1:
        tok = torch.cat([tok, tok.new_zeros(tok.shape[0], n + 1 - tok.shape[1])], 1)
    has = torch.arange(n)[None, :] < (torch.tensor(lens)[:, None] - 1)  # hidden[t+1+i] exists
    return {"h": h, "tok": tok, "has": has, "resp": torch.stack(resp) & has}


# ---------------------------------------------------------------------------------------------- model


def build_speculator(n_predict: int, emb: torch.Tensor, lm: torch.Tensor, init: str,
                     scale: torch.Tensor | None, seed: int) -> MLPSpeculator:
    """tie_weights, inner_dim = emb_dim = D; emb and head = the target's, frozen (module docstring)."""
    V, D = lm.shape
    cfg = MLPSpeculatorConfig(n_predict=n_predict, emb_dim=D, inner_dim=D, vocab_size=V, tie_weights=True)
    m = MLPSpeculator(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.emb[0].weight.copy_(emb)
        m.head[0].weight.copy_(lm)
        if init == "identity":
            m.proj[0].weight.copy_(torch.diag(1.0 / scale) if scale is not None else torch.eye(D))
            m.proj[1].weight.copy_(torch.eye(D))
        else:  # fms-extras MLPSpeculator.reset_parameters
            for p in (m.proj[0].weight, m.proj[1].weight):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(D))
        m.ln[0].weight.fill_(1.0)
        m.ln[0].bias.zero_()
    m.emb[0].weight.requires_grad_(False)
    m.head[0].weight.requires_grad_(False)
    return m


def trainable_state(m: MLPSpeculator) -> dict[str, torch.Tensor]:
    """What ckpt.pt keeps: proj and ln (emb and head are the target's, rebuilt from it)."""
    return {k: v for k, v in m.state_dict().items() if k.split(".")[0] in ("proj", "ln")}


def states(m: MLPSpeculator, h0: torch.Tensor, tok: torch.Tensor) -> list[torch.Tensor]:
    """The state after each stage i < tok.shape[1], [P, D] each: ``m.first_state`` then ``m.stage(i, ...)``
    on the teacher-forced tokens tok[:, i], with ``m.head`` swapped for identities during the call so that
    stage() returns the state twice instead of running the full-vocabulary head."""
    heads = m.head
    m.head = nn.ModuleList([nn.Identity()] * len(heads))
    try:
        state, out = m.first_state(h0), []
        for i in range(tok.shape[1]):
            state, _ = m.stage(i, state, tok[:, i])
            out.append(state)
    finally:
        m.head = heads
    return out


def step_losses(m: MLPSpeculator, b: dict, w_r: torch.Tensor, in_vocab: torch.Tensor, t2r: torch.Tensor,
                args, full: bool = False) -> tuple[torch.Tensor, dict]:
    """sum_i decay^i CE_i (module docstring) and per-stage figures: ce{i}, acc{i} (top-1 over the reduced
    vocabulary on response labels, out-of-vocabulary labels = misses), ceil{i} (the target's own top-1
    there) and with ``full`` acc_full{i} (through the full frozen head)."""
    n = args.n_predict
    outs = states(m, b["h"][:, 0], b["tok"][:, :n])
    total = torch.zeros(())
    stats: dict[str, float] = {}
    for i, s in enumerate(outs):
        lab = b["tok"][:, i + 1]
        has, resp = b["has"][:, i], b["resp"][:, i]
        w = torch.where(resp, 1.0, args.prompt_weight) * has
        rows = has & in_vocab[lab] & (w > 0)
        hr, z_in, wr, lr, rr = b["h"][rows, 1 + i], s[rows], w[rows], t2r[lab[rows]], resp[rows]
        with torch.no_grad():
            teacher = hr @ w_r.T  # [N, Vr] the target's logits at the label's position
            p = torch.softmax(teacher, -1)
        logits = z_in @ w_r.T
        ce = (-(p * torch.log_softmax(logits, -1)).sum(-1) * wr).sum() / wr.sum().clamp(min=1e-9)
        total = total + args.stage_decay ** i * ce
        with torch.no_grad():
            n_resp = resp.sum().clamp(min=1)
            stats[f"ce{i}"] = float(ce.detach())
            stats[f"acc{i}"] = float(((logits.argmax(-1) == lr) & rr).sum() / n_resp)
            stats[f"ceil{i}"] = float(((teacher.argmax(-1) == lr) & rr).sum() / n_resp)
            if full:
                hit = torch.zeros(())
                for c in range(0, len(s), 512):  # [512, V] logits at a time
                    sel = resp[c:c + 512]
                    top = (s[c:c + 512][sel] @ m.head[i].weight.T).argmax(-1)
                    hit += (top == lab[c:c + 512][sel]).sum()
                stats[f"acc_full{i}"] = float(hit / n_resp)
            stats[f"n{i}"] = int(resp.sum())
    return total, stats


@torch.no_grad()
def evaluate(m: MLPSpeculator, seqs: list[dict], ex: tuple[torch.Tensor, torch.Tensor], w_r, in_vocab, t2r, args,
             full: bool) -> dict:
    """Held-out figures, weighted by each batch's response labels per stage."""
    m.eval()
    sums: dict[tuple[str, int], float] = {}
    counts = [0] * args.n_predict
    si, ts = ex
    bs = min(args.token_budget, 1024)
    for c in range(0, len(si), bs):
        b = gather(seqs, si[c:c + bs], ts[c:c + bs], args.n_predict)
        _, st = step_losses(m, b, w_r, in_vocab, t2r, args, full=full)
        for i in range(args.n_predict):
            k = st[f"n{i}"]
            counts[i] += k
            for name in ("ce", "acc", "ceil", "acc_full"):
                if f"{name}{i}" in st:
                    sums[name, i] = sums.get((name, i), 0.0) + st[f"{name}{i}"] * k
    m.train()
    return {f"val/{name}{i}": v / max(counts[i], 1) for (name, i), v in sums.items()}


# ---------------------------------------------------------------------------------------------- main


def settings(cfg):
    """conf/mlp_speculator.yaml's keys as ``args.<key>``, checked."""
    args = options(cfg, "mlp_speculator", {"init": ("identity", "random")})
    if args.n_predict < 2:
        raise ValueError(f"mlp_speculator: n_predict={args.n_predict}; it must be >= 2 (tie_weights shares "
                         "stages >= 1)")
    return args


def run(cfg) -> dict:
    """Train (and export) as conf/mlp_speculator.yaml's keys say; ``cfg`` is a DictConfig
    (``common.compose("mlp_speculator", [...])``) or a plain mapping of every key. Returns the run's summary."""
    args = settings(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    t_load = time.perf_counter()

    V, D, emb, lm = target_tables(args.model)
    seqs = load_data(Path(args.data).expanduser(), False, args.max_seqs, args.first_shard)
    if not seqs:
        raise ValueError(f"{args.data}: no sequences in manifest.json's shards")
    if seqs[0]["hidden"].shape[1] != D:
        raise ValueError(f"{args.data}: hidden states are {seqs[0]['hidden'].shape[1]} wide but {args.model} has "
                         f"hidden_size={D}; the data was made with another target")
    val_idx = list(range(0, len(seqs), max(1, round(1 / args.val_frac)))) if args.val_frac > 0 else []
    vset = set(val_idx)
    train = [s for i, s in enumerate(seqs) if i not in vset]
    val = [seqs[i] for i in val_idx]
    ckpt = out / "ckpt.pt"
    prev = read_checkpoint(ckpt) if args.resume and ckpt.is_file() else None
    freq = prev["freq"] if prev is not None else vocab_by_frequency(train, V)
    r_ids, in_vocab, t2r = reduced_vocab(freq, args.vocab, V)  # reduced vocabulary, ascending target ids
    w_r = lm[r_ids].contiguous()  # [Vr, D] the frozen head's rows
    tr_ex = examples(train, args.n_predict, args.prompt_weight)
    va_ex = examples(val, args.n_predict, 0.0)
    n_resp = sum(len(s["tokens"]) - s["n_prompt"] for s in train)
    cover = sum(int(in_vocab[s["tokens"][s["n_prompt"]:]].sum()) for s in train) / max(n_resp, 1)
    print(f"data: {len(train)} train / {len(val)} val sequences, {sum(len(s['tokens']) for s in train)} tokens "
          f"({n_resp} response), {len(tr_ex[0])} / {len(va_ex[0])} positions; reduced vocab {len(r_ids)} of {V} "
          f"covers {cover:.4f} of response tokens; loaded in {time.perf_counter() - t_load:.0f} s; threads "
          f"{torch.get_num_threads()}", flush=True)

    scale = feature_scale(train, "hidden") if args.init == "identity" and prev is None else None
    m = build_speculator(args.n_predict, emb, lm, args.init, scale, args.seed)
    del emb
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = max(1, math.ceil(len(tr_ex[0]) / args.token_budget))
    total_steps = max(1, int(args.epochs * steps_per_epoch))
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    def lr_at(step: int) -> float:
        return cosine_lr(step, args.lr, args.warmup, total_steps)

    step, elapsed, cursor = 0, 0.0, 0
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(tr_ex[0]), generator=gen)
    if prev is not None:
        missing, unexpected = m.load_state_dict(prev["model"], strict=False)
        assert not unexpected and all(k.split(".")[0] in ("emb", "head") for k in missing), (missing, unexpected)
        opt.load_state_dict(prev["opt"])
        step, elapsed, cursor, order = prev["step"], prev["elapsed"], prev["cursor"], prev["order"]
        gen.set_state(prev["gen"])
        print(f"resumed from {ckpt} at step {step} ({elapsed:.0f} s trained)", flush=True)

    def save() -> None:
        save_atomic({"model": trainable_state(m), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                     "cursor": cursor, "order": order, "gen": gen.get_state(), "freq": freq, "args": vars(args)}, ckpt)

    wb = TrainLogger(out, {**vars(args), "method": "mlp_speculator", "positions": len(tr_ex[0])}, "mlp_speculator",
                     enabled=not args.no_wandb)
    log = (out / "log.jsonl").open("a")

    def record(data: dict) -> None:
        wb.log(data, step)
        log.write(json.dumps({"step": step, **data}) + "\n")
        log.flush()

    bar = tqdm(total=total_steps, initial=step, desc="train mlp_speculator", mininterval=5)
    m.train()
    while step < total_steps:
        if cursor >= len(order):
            order, cursor = torch.randperm(len(tr_ex[0]), generator=gen), 0
        idx = order[cursor:cursor + args.token_budget]
        cursor += args.token_budget
        t0 = time.perf_counter()
        b = gather(train, tr_ex[0][idx], tr_ex[1][idx], args.n_predict)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss, stats = step_losses(m, b, w_r, in_vocab, t2r, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        elapsed += time.perf_counter() - t0
        stats = {k: v for k, v in stats.items() if not k.startswith("n")}
        stats.update(loss=float(loss.detach()), lr=lr_at(step - 1), grad_norm=float(gn), elapsed_s=elapsed)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", acc0=f"{stats['acc0']:.3f}")
        if step % LOG_EVERY == 0 or step == total_steps:
            record(stats)
        end_of_epoch = cursor >= len(order)
        if step % args.ckpt_every == 0 or end_of_epoch or step == total_steps:
            save()
        if end_of_epoch and step < total_steps and val:
            ev = evaluate(m, val, va_ex, w_r, in_vocab, t2r, args, full=False)
            record(ev)
            print(f"step {step}/{total_steps} ({elapsed:.0f} s): "
                  + " ".join(f"{k}={v:.4f}" for k, v in ev.items()), flush=True)
    bar.close()
    print(f"trained {step} steps in {elapsed:.0f} s", flush=True)

    ev = evaluate(m, val, va_ex, w_r, in_vocab, t2r, args, full=True) if val else {}
    if ev:
        record(ev)
        v_resp = torch.cat([s["tokens"][s["n_prompt"]:] for s in val])
        print(f"held-out ({len(val)} sequences, teacher-forced, response labels; the reduced vocabulary "
              f"({len(r_ids)}) covers {float(in_vocab[v_resp].float().mean()):.4f} of them):", flush=True)
        for i in range(args.n_predict):
            print(f"  stage {i}: val/acc{i}={ev[f'val/acc{i}']:.4f} (reduced vocab)  "
                  f"val/acc_full{i}={ev[f'val/acc_full{i}']:.4f} (full vocab)  val/ce{i}={ev[f'val/ce{i}']:.4f}  "
                  f"val/ceil{i}={ev[f'val/ceil{i}']:.4f} (target's own top-1, reduced)", flush=True)
    summary = {"steps": step, "train_seconds": round(elapsed, 1), "positions": len(tr_ex[0]),
               "val_positions": len(va_ex[0]), "vocab": len(r_ids), "vocab_coverage": round(cover, 4),
               **{k: round(v, 4) for k, v in ev.items()}}
    log.write(json.dumps({"final": summary}) + "\n")
    log.close()
    wb.finish()
    if args.export:
        p = write_mlp_speculator(args.export, m.cfg, m.state_dict(), target_tied=not args.export_full)
        print(f"exported to {p} ({'full IBM layout' if args.export_full else 'target-tied: proj and ln only'})",
              flush=True)
    return summary


@hydra.main(version_base="1.3", config_path="conf", config_name="mlp_speculator")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
