"""Train an EAGLE-1 head (or, with ``method=eagle3``, an EAGLE-3 head: ``experiments.train.eagle3``) on
precomputed target features. A Hydra app (conf/eagle.yaml): ``main`` is a thin wrapper around ``run(cfg)``.

    python -m experiments.train.gen_distill_data out=~/.cache/specdec/distill/smollm2-gen    # once, then
    python -m experiments.distill.prefill ... --out ~/.cache/specdec/distill/smollm2-feat     # the features
    python -m experiments.train.eagle data=~/.cache/specdec/distill/smollm2-feat out=runs/eagle1 \
        epochs=6 export=checkpoints/smollm2-135m-instruct-eagle
    python -m experiments.train.eagle ... resume=true       # continues from runs/eagle1/ckpt.pt

Cheap enough for a 2-core CPU because nothing here runs the target: the data holds its features, and
its LM head (= the tied embedding) is used only on a reduced vocabulary (``vocab``, the most frequent
tokens of the target's responses; draft tokens outside it are rare and only cost acceptance).

Losses, per training-time-test step j (``ttt_steps``; step 0 is teacher-forced EAGLE, step j >= 1
feeds the head its own step j-1 outputs, see ``specdec/heads/eagle.py``), weighted 0.8^j:
- EAGLE-1: smooth-L1 regression of the next feature + ``cls_weight`` x cross-entropy against the
  target's distribution softmax(W_r h) on the reduced vocabulary (the EAGLE paper's loss, with W_r in
  place of the full LM head);
- EAGLE-3: cross-entropy only, against the same soft targets, through the head's own small LM head
  (initialised from W_r and the target's final norm); draft vocab = the reduced vocabulary.
Positions whose next token is outside the reduced vocabulary are left out of the cross-entropy (as
EAGLE-3 does); prompt positions count ``prompt_weight`` (the response is what gets drafted).

The input features are divided by their per-dimension RMS over the data (SmolLM2's residual stream has
a few dimensions ~100x the others); the scale is folded into fc at export, so the exported head is a
plain published-layout head. Progress bars (tqdm), W&B offline (under ``out``; a W&B failure never stops
training), a checkpoint every ``ckpt_every`` steps and at each epoch end. Data loading, the reduced
vocabulary, checkpoint I/O and logging are experiments/train/common.py's.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm.auto import tqdm

from experiments.train.common import (TrainLogger, comma_list, cosine_lr, coverage, feature_scale, load_data,
                                      options, read_checkpoint, reduced_vocab, save_atomic, target_parts,
                                      vocab_by_frequency)


# ---------------------------------------------------------------------------------------------- data


def split(seqs: list[dict], val_frac: float, train_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """(train, val) indices. Held out: the sequences whose prompt id is a multiple of round(1 / val_frac), so
    runs on any prefix of the data (``train_tokens``) are scored on the same sequences. Train: the others in
    shard order (the pool's order, whose every prefix keeps the category mix) up to ``train_tokens`` response
    tokens."""
    every = max(1, round(1 / val_frac)) if val_frac > 0 else 0
    val = [i for i, s in enumerate(seqs) if every and s["prompt_id"] % every == 0]
    held, train, n = set(val), [], 0
    for i, s in enumerate(seqs):
        if i in held:
            continue
        if train_tokens is not None and n >= train_tokens:
            break
        train.append(i)
        n += len(s["tokens"]) - s["n_prompt"]
    return train, val


def batches(seqs: list[dict], token_budget: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped by similar length so a batch holds <= token_budget padded positions."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["tokens"]))
    out, cur, longest = [], [], 0
    for i in order:
        n = len(seqs[i]["tokens"])
        if cur and max(longest, n) * (len(cur) + 1) > token_budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(seqs: list[dict], idx: list[int], steps: int, feat_key: str) -> dict:
    """Padded tensors for one batch: feat [B, T, F], next_tok [B, T+steps-1], hid [B, T+steps, D] (target
    features shifted so hid[:, t+1+j] is the label of step j at t), n_rows [B], n_prompt [B]."""
    B = len(idx)
    rows = [len(seqs[i]["tokens"]) - 1 for i in idx]
    T = max(rows)
    F_ = seqs[idx[0]][feat_key].shape[1]
    D = seqs[idx[0]]["hidden"].shape[1]
    feat = torch.zeros(B, T, F_)
    hid = torch.zeros(B, T + steps, D)
    nxt = torch.zeros(B, T + steps - 1, dtype=torch.long)
    for b, i in enumerate(idx):
        s, n = seqs[i], rows[b]
        feat[b, :n] = s[feat_key].float()
        hid[b, :n] = s["hidden"].float()
        m = min(n, T + steps - 1)
        nxt[b, :m] = s["tokens"][1:1 + m]
    return {"feat": feat, "hid": hid, "next": nxt, "rows": torch.tensor(rows),
            "n_prompt": torch.tensor([seqs[i]["n_prompt"] for i in idx])}


# ---------------------------------------------------------------------------------------------- loss


def step_losses(head, batch: dict, emb_table: torch.Tensor, w_r: torch.Tensor, in_vocab: torch.Tensor,
                args, method: str) -> tuple[torch.Tensor, dict]:
    """Weighted TTT loss of one batch and its figures (ce, reg, acc per step). The LM head is applied only
    to the rows that count (valid positions; the cross-entropy only where the next token is in the
    reduced vocabulary): on this CPU it costs as much as the rest of the head."""
    steps = args.ttt_steps
    emb = F.embedding(batch["next"], emb_table)  # [B, T+steps-1, D]
    outs = head.forward_train(emb, batch["feat"], steps)  # raw features; head.feat_scale normalises them
    B, T = batch["feat"].shape[:2]
    t = torch.arange(T)[None, :]
    total = torch.zeros(())
    stats = {}
    for j, out in enumerate(outs):
        valid = (t + 1 + j) < batch["rows"][:, None]  # [B, T]: the feature of t+1+j exists
        resp = (t + 2 + j) >= batch["n_prompt"][:, None]  # the token it predicts is in the response
        nxt = torch.zeros(B, T, dtype=torch.long)  # the target's token at t+2+j (its greedy choice in responses)
        m = min(T, batch["next"].shape[1] - 1 - j)
        nxt[:, :m] = batch["next"][:, 1 + j:1 + j + m]
        h = batch["hid"][:, 1 + j:1 + j + T]  # [B, T, D] the target's feature at t+1+j
        w = (valid.float() * torch.where(resp, 1.0, args.prompt_weight))
        ce_rows = valid & in_vocab[nxt] & (resp if args.prompt_weight == 0 else torch.ones_like(resp))
        o, hr, wc, tok = out[ce_rows], h[ce_rows], w[ce_rows], nxt[ce_rows]  # [N, D], [N, D], [N], [N]
        with torch.no_grad():
            p = torch.softmax(hr @ w_r.T, -1)  # [N, Vr] the target's law on the reduced vocabulary
        logits = head.draft_logits(o) if method == "eagle3" else o @ w_r.T
        cls = (-(p * torch.log_softmax(logits.float(), -1)).sum(-1) * wc).sum() / wc.sum().clamp(min=1)
        loss = cls
        if method == "eagle":
            reg = (F.smooth_l1_loss(out, h, reduction="none").mean(-1) * w).sum() / w.sum().clamp(min=1)
            loss = reg + args.cls_weight * cls
            stats[f"reg{j}"] = float(reg.detach())
        total = total + (0.8 ** j) * loss
        with torch.no_grad():
            r = resp[ce_rows]
            hit = ((logits.argmax(-1) == args._t2r[tok]) & r).sum()
            acc = hit / r.sum().clamp(min=1)
            every = (valid & resp).sum()  # all response positions: a token outside the vocabulary is a miss
        stats[f"ce{j}"], stats[f"acc{j}"] = float(cls.detach()), float(acc)
        stats[f"acc_all{j}"] = float(hit / every.clamp(min=1))
    return total, stats


# ---------------------------------------------------------------------------------------------- main


def measure_tau(head: str, method: str, categories="all", per_category: int = 10, k: int = 4,
                max_tokens: int = 128, batch: int = 8, features: str = "exact", check: bool = True) -> dict:
    """tau per Spec-Bench category with the real pipeline (LLM + speculative_config), greedy, first turns,
    ``batch`` requests at a time (greedy tau does not depend on the batch); plain decoding of the same
    prompts checks greedy equality. Returns {category: {tau, tokens, mismatches}} plus "all"/"mt_bench"."""
    from specdec import LLM, SamplingParams
    from specdec.experiment.data import MT_BENCH_CATEGORIES, load_spec_bench
    from specdec.datamodel.metrics import sum_counts, tau

    cls = "proposers.eagle:EagleProposer" if method == "eagle" else "proposers.eagle3:Eagle3Proposer"
    llm = LLM("smollm2-135m-instruct", max_num_seqs=batch, max_model_len=4096)
    spec = llm.with_speculation({"method": cls, "num_speculative_tokens": k,
                                 "options": {"head": head, "features": features}})
    prompts = load_spec_bench(categories, per_category=per_category)
    ids = [{"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": p.turns[0]}])} for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = spec.generate(ids, sp, use_tqdm=True)
    t_spec = time.perf_counter() - t0
    refs = llm.without_speculation().generate(ids, sp, use_tqdm=True) if check else [None] * len(outs)
    res: dict[str, dict] = {}
    cats = dict.fromkeys(p.category for p in prompts)
    groups = {c: [i for i, p in enumerate(prompts) if p.category == c] for c in cats}
    groups["mt_bench"] = [i for i, p in enumerate(prompts) if p.category in MT_BENCH_CATEGORIES]
    groups["all"] = list(range(len(prompts)))
    for name, rows in groups.items():
        if not rows:
            continue
        counts = sum_counts([outs[i].metrics.spec_token_acceptance_counts for i in rows])
        res[name] = {"tau": round(tau(counts), 3), "prompts": len(rows),
                     "tokens": sum(len(outs[i].outputs[0].token_ids) for i in rows),
                     "acceptance_per_position": [round(c / counts[0], 3) for c in counts[1:]],
                     "mismatches": None if not check else
                     sum(outs[i].outputs[0].token_ids != refs[i].outputs[0].token_ids for i in rows)}
    res["spec_seconds"] = round(t_spec, 1)
    return res


def measure_cost(head: str, method: str, k: int = 4, n_prompts: int = 4, max_tokens: int = 64) -> dict:
    """v and c at batch 1 (DESIGN.md's speedup model): v = target time for k+1 tokens / for 1 token, c = draft
    time per drafted token / target time for 1 token, from the step times of speculative and plain runs on
    the first MT-bench questions; plus both decoding rates and the predicted speedup tau / (v + k c)."""
    from specdec import LLM, SamplingParams
    from specdec.experiment.data import load_spec_bench

    cls = "proposers.eagle:EagleProposer" if method == "eagle" else "proposers.eagle3:Eagle3Proposer"
    llm = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=4096)
    prompts = [{"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": p.turns[0]}])}
               for p in load_spec_bench("mt_bench", per_category=1)[:n_prompts]]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = llm.without_speculation()
    spec = llm.with_speculation({"method": cls, "num_speculative_tokens": k, "options": {"head": head}})
    for m in (plain, spec):  # warm-up
        m.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        m.reset_metrics()
    t0 = time.perf_counter()
    n_plain = sum(len(o.outputs[0].token_ids) for o in plain.generate(prompts, sp, use_tqdm=False))
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_spec = sum(len(o.outputs[0].token_ids) for o in spec.generate(prompts, sp, use_tqdm=False))
    t_spec = time.perf_counter() - t0
    m = spec.get_metrics()
    one = t_plain / n_plain  # ~ one target forward of 1 token (+ the step loop)
    v = m.mean_step_time_s["score"] / one
    c = m.mean_step_time_s["propose"] / k / one
    return {"v": round(v, 2), "c": round(c, 3), "tau": round(m.mean_acceptance_length, 3),
            "predicted_speedup": round(m.mean_acceptance_length / (v + k * c), 3),
            "plain_tok_s": round(n_plain / t_plain, 2), "spec_tok_s": round(n_spec / t_spec, 2),
            "speedup": round((n_spec / t_spec) / (n_plain / t_plain), 3), "step_times_s": m.mean_step_time_s}


def settings(cfg) -> SimpleNamespace:
    """conf/eagle.yaml's keys as ``args.<key>``, checked, with ttt_steps and amp resolved."""
    args = options(cfg, "eagle", {"method": ("eagle", "eagle3"), "amp": ("auto", "bf16", "none"),
                                  "eval_features": ("exact", "threaded")})
    args.eval_categories = comma_list(args.eval_categories)
    if args.ttt_steps is None:
        args.ttt_steps = 3 if args.method == "eagle3" else 1
    if args.amp == "auto":
        from specdec.engine.cpu.build import cpu_flags

        args.amp = "bf16" if "avx512_bf16" in cpu_flags() else "none"
    return args


def public_args(args) -> dict:
    """The command line as a run records it (private ``_``-prefixed fields dropped)."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def amp(args):
    """The autocast context of ``amp``: bf16 matmuls, fp32 master weights (AdamW steps them in fp32)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16")


@torch.no_grad()
def evaluate(head, seqs, val_idx, emb_table, w_r, in_vocab, args) -> dict:
    head.eval()
    agg: dict[str, float] = {}
    n = 0
    for idx in batches([seqs[i] for i in val_idx], args.token_budget, random.Random(0)):
        b = collate([seqs[i] for i in val_idx], idx, args.ttt_steps, args._feat_key)
        with amp(args):
            _, st = step_losses(head, b, emb_table, w_r, in_vocab, args, args.method)
        for k, v in st.items():
            agg[k] = agg.get(k, 0.0) + v
        n += 1
    head.train()
    return {f"val/{k}": v / max(n, 1) for k, v in agg.items()}


def run(cfg) -> None:
    """Train, score (heldout) or measure (eval) as conf/eagle.yaml's keys say; ``cfg`` is a DictConfig
    (``common.compose("eagle", [...])``) or a plain mapping of every key."""
    args = settings(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval and args.eval_cost:
        res = measure_cost(args.eval, args.method)
        print(json.dumps(res, indent=1), flush=True)
        return
    if args.eval:
        cats = args.eval_categories if args.eval_categories in ("all", "mt_bench") else args.eval_categories.split(",")
        res = measure_tau(args.eval, args.method, cats, args.eval_per_category, features=args.eval_features)
        print(json.dumps(res, indent=1), flush=True)
        out = Path(args.out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"tau_{args.eval_features}.json").write_text(json.dumps(res, indent=1))
        return
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)

    from specdec.heads import HeadConfig, build_head

    t_load = time.perf_counter()
    tcfg, emb_table, final_norm, lm_head = target_parts(args.model)
    seqs = load_data(Path(args.data).expanduser(), args.method == "eagle3", args.max_seqs, args.first_shard)
    for extra_dir in args.extra_data:
        seqs += load_data(Path(extra_dir).expanduser(), args.method == "eagle3", args.max_seqs)
    args._feat_key = "aux" if args.method == "eagle3" else "hidden"
    train_idx, val_idx = split(seqs, args.val_frac, args.train_tokens)
    train = [seqs[i] for i in train_idx]
    prev = None  # a run to continue (resume=true) or start from (init=): its vocabulary and input scale
    ckpt = out / "ckpt.pt"
    if args.resume and ckpt.is_file():
        prev = read_checkpoint(ckpt)
    elif args.init or args.heldout:
        src = Path(args.init or args.heldout).expanduser()
        prev = (prev_from_export(src, args.method, tcfg.vocab_size, lambda: feature_scale(train or seqs, args._feat_key))
                if src.is_dir() else read_checkpoint(src))
    if args.heldout:  # the checkpoint's own vocabulary and TTT unroll unless ttt_steps says otherwise
        args.vocab = prev["args"]["vocab"]
    freq = prev["freq"] if prev is not None else vocab_by_frequency(train, tcfg.vocab_size)
    r_ids, in_vocab, args._t2r = reduced_vocab(freq, args.vocab, tcfg.vocab_size)
    w_r = lm_head[r_ids]  # [Vr, D]
    n_resp = sum(len(s["tokens"]) - s["n_prompt"] for s in train)
    cover = coverage(train, in_vocab)
    scale = prev["scale"] if prev is not None else feature_scale(train, args._feat_key)
    print(f"data: {len(train)} train / {len(val_idx)} val sequences, {sum(len(s['tokens']) for s in train)} tokens "
          f"({n_resp} response); reduced vocab {len(r_ids)} covers {cover:.4f} of response tokens; "
          f"loaded in {time.perf_counter() - t_load:.0f} s; threads {torch.get_num_threads()}", flush=True)

    extra = {}
    if args.method == "eagle3":
        extra = dict(draft_vocab_size=len(r_ids))
    hcfg = HeadConfig.for_target(tcfg, args.method, **extra)
    head = build_head(hcfg)
    head.feat_scale = scale
    if args.method == "eagle3":
        with torch.no_grad():  # start from the target's own output map
            head.lm_head.weight.copy_(w_r)  # the target's LM head rows; the norm starts at 1 (the target's
            head.set_vocab(r_ids)  # final-norm weights on a random start give logits of std ~30, CE ~40)
    if (args.init or args.heldout) and not args.resume:
        sd = prev["head"]
        old_vocab = int(prev["args"]["vocab"])
        if args.method == "eagle3" and old_vocab != args.vocab:
            sd = regrow_draft_vocab(sd, freq[:old_vocab].sort().values, r_ids, lm_head)
            print(f"draft vocabulary {old_vocab} -> {args.vocab}: the {int(in_vocab[freq[:old_vocab]].sum())} ids "
                  "kept keep their trained rows, the others start from the target's LM head", flush=True)
        head.load_state_dict(sd)
        print(f"weights from {args.init or args.heldout}", flush=True)
    if args.heldout:
        ev = evaluate(head, seqs, val_idx, emb_table, w_r, in_vocab, args) | {
            "ckpt": args.heldout, "ttt_steps": args.ttt_steps, "val_sequences": len(val_idx), "vocab": args.vocab,
            "trained_response_tokens": prev["args"].get("train_tokens"), "trained_steps": prev["step"]}
        if args.by_source:  # the same figures per sequence source (a trace's category, the pool's category)
            groups: dict[str, list[int]] = {}
            for i in val_idx:
                groups.setdefault(seqs[i]["source"], []).append(i)
            ev["by_source"] = {src: evaluate(head, seqs, idx, emb_table, w_r, in_vocab, args) | {
                "sequences": len(idx), "coverage": coverage([seqs[i] for i in idx], in_vocab)}
                for src, idx in sorted(groups.items())}
        print(json.dumps(ev, indent=1), flush=True)
        (out / "heldout.json").write_text(json.dumps(ev, indent=1))
        return
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = len(batches(train, args.token_budget, random.Random(0)))
    total_steps = max(1, int(args.epochs * steps_per_epoch))
    if args.max_steps:  # the schedule ends there
        total_steps = min(total_steps, args.max_steps)

    def lr_at(step: int) -> float:
        return cosine_lr(step, args.lr, args.warmup, total_steps)

    step, elapsed = 0, 0.0
    epoch_batches: list[list[int]] = []  # what is left of the current epoch, in order
    if args.resume and ckpt.is_file():
        st = prev
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        rng.setstate(st["rng"])
        epoch_batches = st["epoch_batches"]
        print(f"resumed from {ckpt} at step {step} ({elapsed:.0f} s trained)", flush=True)

    def save() -> None:
        save_atomic({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                     "rng": rng.getstate(), "epoch_batches": epoch_batches, "freq": freq, "scale": scale,
                     "args": public_args(args)}, ckpt)

    wb = TrainLogger(out, public_args(args), args.method, enabled=not args.no_wandb)
    log = (out / "log.jsonl").open("a")
    bar = tqdm(total=total_steps, initial=step, desc=f"train {args.method}", mininterval=5)
    stop_at = total_steps
    while step < stop_at:
        if not epoch_batches:
            epoch_batches = batches(train, args.token_budget, rng)
        idx = epoch_batches.pop()
        t0 = time.perf_counter()
        b = collate(train, idx, args.ttt_steps, args._feat_key)
        if args.noise:
            b["feat"] = b["feat"] + (torch.rand_like(b["feat"]) - 0.5) * args.noise * scale
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with amp(args):
            loss, stats = step_losses(head, b, emb_table, w_r, in_vocab, args, args.method)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        elapsed += time.perf_counter() - t0
        stats.update(loss=float(loss.detach()), lr=lr_at(step - 1), grad_norm=float(gn), elapsed_s=elapsed)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", acc0=f"{stats['acc0']:.3f}")
        if step % 20 == 0 or step == total_steps:
            wb.log(stats, step)
            log.write(json.dumps({"step": step, **stats}) + "\n")
            log.flush()
        end_of_epoch = not epoch_batches
        if step % args.ckpt_every == 0 or end_of_epoch or step == stop_at:
            save()
            if end_of_epoch or step == stop_at:
                ev = evaluate(head, seqs, val_idx, emb_table, w_r, in_vocab, args)
                wb.log(ev, step)
                log.write(json.dumps({"step": step, **ev}) + "\n")
                log.flush()
                figures = " ".join(f"{k}={v:.4f}" for k, v in ev.items())
                print(f"step {step}/{total_steps} ({elapsed:.0f} s): {figures}", flush=True)
    bar.close()
    wb.finish()
    print(f"trained {step} steps in {elapsed:.0f} s", flush=True)
    if args.export:
        export(head, scale, freq, args, step, elapsed, len(train), sum(len(s["tokens"]) for s in train))
    if args.export_train_state:
        export_train_state(head, scale, freq, args, step, elapsed)


def regrow_draft_vocab(sd: dict, old_ids: torch.Tensor, new_ids: torch.Tensor, lm_head: torch.Tensor) -> dict:
    """An EAGLE-3 state dict moved from draft vocabulary ``old_ids`` ([Vo] ascending target ids) to ``new_ids``
    ([Vn] ascending): an id in both keeps its trained ``lm_head`` row; a new id starts from the target's LM head
    row (``lm_head`` [V, D]), which is where every row started (``head.lm_head`` is initialised from the target's
    rows); ``d2t`` / ``t2d`` describe ``new_ids``. Growing the vocabulary raises the share of the target's tokens
    the head can draft at all (MT-bench responses: 87.6% at 4,096 ids, 93.7% at 8,192; experiments/LOG.md)."""
    W_old = sd["lm_head.weight"]  # [Vo, D]
    if W_old.shape[0] != old_ids.numel():
        raise ValueError(f"regrow_draft_vocab: lm_head has {W_old.shape[0]} rows for {old_ids.numel()} draft ids")
    where = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
    where[old_ids] = torch.arange(old_ids.numel())
    src = where[new_ids]  # [Vn]: the old row of each new id, -1 when it is new
    kept = src >= 0
    W = lm_head[new_ids].to(W_old.dtype).clone()  # [Vn, D]
    W[kept] = W_old[src[kept]]
    t2d = torch.zeros_like(sd["t2d"])
    t2d[new_ids] = True
    return sd | {"lm_head.weight": W, "d2t": new_ids - torch.arange(new_ids.numel()), "t2d": t2d}


def prev_from_export(path: Path, method: str, vocab_size: int, scale_fn) -> dict:
    """A warm start from an exported head directory (published layout + draft_vocab.safetensors), in the
    shape of a run checkpoint: {"head": training-layout state dict, "freq", "scale", "step", "args"}.

    Export folded the input scale into fc; this unfolds it with a scale measured afresh on the training data
    (``scale_fn() -> [F]``): fc(x / s) * s == fc(x), so the head computes the same function (up to its bf16
    rounding) whatever s is. So any shipped head continues training on any machine, with no run checkpoint.
    """
    from safetensors.torch import load_file

    from specdec.heads import read_head

    cfg, sd, raw = read_head(path, method)
    vocab_file = path / "draft_vocab.safetensors"
    if not vocab_file.is_file():
        raise FileNotFoundError(f"{path} has no draft_vocab.safetensors (the token frequencies its training "
                                "vocabulary came from); pass a run's ckpt.pt to init=/heldout= instead")
    ids = load_file(str(vocab_file))["ids"].long()
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    seen[ids] = True
    freq = torch.cat([ids, torch.nonzero(~seen).flatten()])  # [V]: the stored order, then unseen ids by id
    meta = raw.get("specdec_training") or {}
    vocab = int(cfg.draft_vocab_size) if method == "eagle3" else int(meta.get("vocab") or 0)
    if vocab <= 0:
        raise ValueError(f"{path}/config.json has no specdec_training.vocab, so the reduced vocabulary it was "
                         "trained on is unknown; pass a run's ckpt.pt instead")
    if method == "eagle3":  # the head's own draft vocabulary must be the one freq gives
        own = torch.arange(vocab) + sd["d2t"]
        if not torch.equal(own.sort().values, freq[:vocab].sort().values):
            raise ValueError(f"{path}: draft_vocab.safetensors does not match the head's d2t; re-export the head")
    scale = scale_fn().float()
    w = sd["fc.weight"].float().clone()
    if method == "eagle":  # only the feature half of fc's input was normalised
        D = w.shape[1] // 2
        w[:, D:] = w[:, D:] * scale
    else:
        w = w * scale
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()} | {"fc.weight": w}
    return {"head": sd, "freq": freq, "scale": scale, "step": int(meta.get("steps") or 0),
            "args": {"vocab": vocab, "train_tokens": None, "init": str(path)}}


def export(head, scale: torch.Tensor, freq: torch.Tensor, args, step: int, elapsed: float, n_seqs: int,
           n_tok: int) -> None:
    """Fold the input scale into fc and write the head (published layout, bf16) + its token frequencies."""
    from safetensors.torch import save_file

    from specdec.heads import write_eagle1, write_eagle3

    sd = {k: v.detach().clone() for k, v in head.state_dict().items()}
    w = sd["fc.weight"]
    if args.method == "eagle":  # fc reads cat(embed, feature): only the feature half was normalised
        D = w.shape[1] // 2
        w[:, D:] = w[:, D:] / scale
    else:
        sd["fc.weight"] = w / scale
    meta = dict(specdec_training={"steps": step, "seconds": round(elapsed), "sequences": n_seqs, "tokens": n_tok,
                                  "ttt_steps": args.ttt_steps, "vocab": args.vocab, "data": str(args.data)})
    writer = write_eagle1 if args.method == "eagle" else write_eagle3
    path = writer(args.export, head.cfg, sd, **meta)
    save_file({"ids": freq[: max(args.vocab, 32768)].contiguous()}, str(Path(path) / "draft_vocab.safetensors"))
    print(f"exported to {path}", flush=True)


def export_train_state(head, scale: torch.Tensor, freq: torch.Tensor, args, step: int, elapsed: float) -> None:
    """Write a small warm start (``init=FILE``) in a run checkpoint's shape: the head's training-layout
    weights in bf16 (the input scale not folded in), its token frequencies and input scale, and no optimiser
    state: training continues from it on any machine without the run directory (an exported head directory,
    ``init=<head dir>``, does too, with its input scale measured afresh)."""
    path = Path(args.export_train_state).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).clone()
          for k, v in head.state_dict().items()}
    note = (f"warm start for python -m experiments.train.{args.method} init=FILE (head weights in bf16, no "
            f"optimiser state); {step} steps in this run, from {args.init or 'scratch'}")
    save_atomic({"head": sd, "freq": freq, "scale": scale, "step": step, "elapsed": elapsed, "args": public_args(args),
                 "note": note}, path)
    print(f"train state written to {path}", flush=True)


@hydra.main(version_base="1.3", config_path="conf", config_name="eagle")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
