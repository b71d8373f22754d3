"""Self-distillation data for EAGLE heads: the target's own greedy responses to training prompts, with its
hidden states, written in shards that ``train_eagle.py`` / ``train_eagle3.py`` read.

    python experiments/gen_distill_data.py --out ~/.cache/specdec/distill/smollm2 \
        --gsm8k 600 --self-instruct 175 --generated 500 --max-new-tokens 160 --batch 16 --threads 1

Prompts: GSM8K *train* questions, the Self-Instruct seed tasks and prompts built here from templates
(:func:`generated_prompts`), each wrapped in the target's chat template exactly as ``specdec.run`` does.
Spec-Bench is never read. Generation is greedy on the native engine with continuous batching (a slot is
refilled as soon as its sequence ends), so the stored responses are what the target itself would say.

Per sequence a shard stores the token ids (prompt + response), the prompt length, and for every token
but the last (the last one is never fed): the last-layer hidden state after the final norm ([T-1, D],
the EAGLE-1 feature and, through the LM head, the target's distribution) and the outputs of the
EAGLE-3 layers ([T-1, 3D], see ``proposers.eagle_head.eagle3_layers``), both fp16 (the residual stream
reaches ~3e4 on SmolLM2, inside fp16's range; bf16 would lose 3 more mantissa bits).
``--resume`` skips the prompts already in finished shards.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Programmatic prompts: task templates x topics, in the spirit of chat benchmarks' categories (writing,
# roleplay, reasoning, coding, extraction, STEM, humanities) without copying any evaluation prompt.
_TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "climate change", "the stock market",
    "machine learning", "the human immune system", "volcanoes", "the Roman Empire", "renewable energy",
    "the water cycle", "social media", "electric cars", "the Renaissance", "vaccines", "coffee",
    "the internet", "honey bees", "the Great Wall of China", "plate tectonics", "inflation",
    "meditation", "the Olympic Games", "quantum computers", "jazz music", "recycling", "the moon landing",
    "sleep", "chess", "the printing press", "rainforests", "cryptocurrency", "the Industrial Revolution",
    "DNA", "earthquakes", "public libraries", "remote work", "the Silk Road", "gravity", "ocean tides",
    "democracy", "antibiotics", "video games", "the Amazon river", "solar panels", "friendship",
    "time management", "ancient Egypt", "artificial sweeteners", "urban gardening", "the periodic table",
    "supply and demand", "Shakespeare", "dinosaurs", "nuclear energy", "minimalism", "the Cold War",
    "bicycles", "mountain climbing", "online privacy", "the human brain", "tea ceremonies", "robots",
    "space tourism", "fast fashion", "the metric system", "wolves", "bread baking", "hurricanes",
]
_PEOPLE = ["a pirate captain", "a medieval knight", "a detective", "a friendly robot", "a chef", "a pilot",
           "a marine biologist", "a famous painter", "an astronaut", "a high school coach", "a librarian",
           "a travel guide in Rome", "a wizard", "a startup founder", "a park ranger", "a history teacher"]
_LANGS = ["Python", "JavaScript", "C++", "Java", "Rust", "Go", "SQL", "Bash"]
_CODE_TASKS = [
    "reverses a linked list", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts the words in a text file", "computes the factorial of a number", "finds the largest element "
    "in an array", "removes duplicates from a list", "implements binary search", "validates an email "
    "address", "converts Celsius to Fahrenheit", "computes the greatest common divisor of two numbers",
    "sorts a list of dictionaries by a key", "reads a CSV file and prints the average of a column",
    "checks whether a number is prime", "implements a stack with push and pop", "flattens a nested list",
    "returns the n-th Fibonacci number iteratively", "counts vowels in a string",
]
_TEMPLATES = [
    "Write a short blog post about {t}.", "Explain {t} to a ten-year-old.", "What are the pros and cons of {t}?",
    "Write a poem about {t}.", "Give me five interesting facts about {t}.", "Summarize the history of {t} in a "
    "paragraph.", "Write a persuasive essay introduction arguing that everyone should learn about {t}.",
    "Compose a short story in which {t} plays an important role.", "Describe how {t} affects everyday life.",
    "What are common misconceptions about {t}?", "Create a quiz with three questions about {t}.",
    "Write a product description for a board game about {t}.", "Draft an email inviting colleagues to a "
    "talk on {t}.", "Compare {t} and {u}. How are they similar and different?", "How would you teach {t} "
    "in a one-hour class? Give a lesson plan.", "Write a dialogue between two friends discussing {t}.",
    "List the key terms someone should know about {t}, with a one-line definition each.",
    "What ethical questions does {t} raise?", "Write a tweet thread (five tweets) about {t}.",
]
_ROLE = ["Pretend you are {p}. Describe your typical day.", "You are {p}. Give advice to a newcomer in your "
         "field.", "Act as {p} and explain {t} in your own words.", "Imagine you are {p}. Write a letter to "
         "your younger self."]
_CODE = ["Write a {l} function that {c}.", "Explain step by step how to write a {l} program that {c}.",
         "Write a {l} function that {c}, and add a short test."]
_EXTRACT = [
    "Extract all the names, dates and places from this text: {s}", "Classify the sentiment of this review "
    "as positive, negative or neutral, and explain why: {s}", "Turn the following into a JSON object with "
    "the fields who, what, when: {s}", "Give three keywords for the following text: {s}",
]
_SENTENCES = [
    "On March 3rd, Maria Lopez opened a small bakery in Lisbon, and by June it had a queue every morning.",
    "The hotel was clean, but the staff ignored our requests and the breakfast was cold every day.",
    "In 1998, Tom and his sister Anna sailed from Dublin to Reykjavik in a boat they had built themselves.",
    "I loved this phone: the battery lasts two days and the camera takes great photos at night.",
    "The city council of Springfield voted on Tuesday to close the old bridge until repairs are finished.",
    "After three years of research in Kenya, Dr. Amina Yusuf published a study on elephant migration.",
]
_REASON = [
    "If a train leaves at 3 pm and travels {a} km at {b} km/h, when does it arrive? Explain.",
    "A shop sells pens at ${a} each and notebooks at ${b} each. How much do 3 pens and 2 notebooks cost?",
    "I have {a} apples and give away {b}. Then I buy twice as many as I have left. How many do I have?",
    "What is {a} multiplied by {b}? Show your work.", "Is {a} a prime number? Explain your reasoning.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
]


def generated_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts from the templates above (seeded, so a resume regenerates the same list)."""
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:
        kind = rng.random()
        t, u = rng.sample(_TOPICS, 2)
        if kind < 0.5:
            s = rng.choice(_TEMPLATES).format(t=t, u=u)
        elif kind < 0.62:
            s = rng.choice(_ROLE).format(p=rng.choice(_PEOPLE), t=t)
        elif kind < 0.8:
            s = rng.choice(_CODE).format(l=rng.choice(_LANGS), c=rng.choice(_CODE_TASKS))
        elif kind < 0.9:
            s = rng.choice(_EXTRACT).format(s=rng.choice(_SENTENCES))
        else:
            s = rng.choice(_REASON).format(a=rng.randint(2, 97), b=rng.randint(2, 60))
        out.add(s)
    return sorted(out, key=lambda x: rng.random())


def training_prompts(n_gsm8k: int, n_self_instruct: int, n_generated: int, seed: int = 0) -> list[tuple[str, str]]:
    """(source, user message) pairs, interleaved so any prefix of the list is a mix of all sources."""
    rng = random.Random(seed)
    gsm = [json.loads(line)["question"] for line in (DATA / "gsm8k_train.jsonl").read_text().splitlines()]
    rng.shuffle(gsm)
    si = []
    for line in (DATA / "self_instruct_seed_tasks.jsonl").read_text().splitlines():
        row = json.loads(line)
        inp = row["instances"][0]["input"] if row["instances"] else ""
        si.append(row["instruction"] + ("\n\n" + inp if inp else ""))
    rng.shuffle(si)
    items = ([("gsm8k", q) for q in gsm[:n_gsm8k]] + [("self_instruct", q) for q in si[:n_self_instruct]]
             + [("generated", q) for q in generated_prompts(n_generated, seed)])
    rng.shuffle(items)
    return items


@torch.inference_mode()
def generate(engine, prompts: list[list[int]], *, max_new_tokens: int, batch: int, eos: int,
             hidden_layers: tuple[int, ...], prefill_tokens: int = 1024):
    """Greedy continuations with continuous batching. Yields (index, token ids, hidden [T-1, D] fp16,
    aux [T-1, len(hidden_layers) * D] fp16) as sequences finish (any order)."""
    from specdec.engine import ForwardBatch

    todo = list(range(len(prompts)))[::-1]
    active: dict[int, dict] = {}  # slot -> state
    while todo or active:
        # prefill new prompts into free slots, a bounded number of tokens per forward
        new, n_tok = [], 0
        while todo and len(active) + len(new) < batch and (not new or n_tok + len(prompts[todo[-1]]) <= prefill_tokens):
            i = todo.pop()
            new.append(i)
            n_tok += len(prompts[i])
        feeds = []  # (slot, tokens to feed)
        for i in new:
            slot = engine.allocate_slot()
            active[slot] = {"i": i, "tokens": list(prompts[i]), "n_new": 0, "hid": [], "aux": []}
            feeds.append((slot, prompts[i]))
        if not new:  # decode one token for every active sequence
            feeds = [(slot, st["tokens"][-1:]) for slot, st in active.items()]
        qlens = [len(f) for _, f in feeds]
        out = engine.forward(ForwardBatch(
            token_ids=torch.tensor([t for _, f in feeds for t in f], dtype=torch.long),
            slots=[s for s, _ in feeds], query_lens=qlens,
            logits_indices=torch.tensor(qlens).cumsum(0) - 1, hidden_layers=hidden_layers))
        aux = torch.cat(out.aux_hidden_states, dim=-1) if hidden_layers else None
        nxt = out.logits.argmax(-1).tolist()
        row = 0
        for (slot, f), tok in zip(feeds, nxt):
            st = active[slot]
            st["hid"].append(out.hidden_states[row:row + len(f)].half())
            if aux is not None:
                st["aux"].append(aux[row:row + len(f)].half())
            row += len(f)
            st["tokens"].append(tok)
            st["n_new"] += 1
            full = len(st["tokens"]) >= engine.max_model_len
            if tok == eos or st["n_new"] >= max_new_tokens or full:
                engine.free_slot(slot)
                del active[slot]
                yield (st["i"], st["tokens"], torch.cat(st["hid"]),
                       torch.cat(st["aux"]) if st["aux"] else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True, help="directory for shard_*.pt and manifest.json")
    ap.add_argument("--gsm8k", type=int, default=600)
    ap.add_argument("--self-instruct", type=int, default=175)
    ap.add_argument("--generated", type=int, default=500)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    ap.add_argument("--batch", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--shard-size", type=int, default=100, help="sequences per shard file")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 is best on a busy 2-core box)")
    ap.add_argument("--no-aux", action="store_true", help="skip the EAGLE-3 layers (EAGLE-1 data only, 4x smaller)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke tests)")
    ap.add_argument("--resume", action="store_true", help="skip prompts already in finished shards")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from proposers.eagle_head import eagle3_layers
    from specdec.engine.loader import load_engine, load_tokenizer

    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(args.model)
    engine = load_engine(args.model, num_slots=args.batch,
                         max_model_len=args.max_prompt_tokens + args.max_new_tokens + 1)
    layers = () if args.no_aux else eagle3_layers(engine.num_layers)
    items = training_prompts(args.gsm8k, args.self_instruct, args.generated, args.seed)[: args.limit]
    ids = []
    for _, text in items:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids.append(tok(chat, add_special_tokens=False)["input_ids"])
    keep = [i for i in range(len(items)) if len(ids[i]) <= args.max_prompt_tokens]
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if (args.resume and manifest_path.exists()) else {"shards": []}
    done = {i for s in manifest["shards"] for i in s["prompt_indices"]}
    keep = [i for i in keep if i not in done]
    manifest.update(model=args.model, hidden_layers=list(layers), hidden_size=engine.hidden_size,
                    max_new_tokens=args.max_new_tokens, seed=args.seed,
                    sources={s: sum(1 for x in items if x[0] == s) for s in ("gsm8k", "self_instruct", "generated")})
    print(f"{len(keep)} prompts to generate ({len(done)} already done, {len(items) - len(keep) - len(done)} too long); "
          f"aux layers {layers}; threads {torch.get_num_threads()}", flush=True)

    buf: list[tuple] = []
    t0 = time.perf_counter()
    n_tok = n_new = 0
    bar = tqdm(total=len(keep), desc="distill", mininterval=10)

    def flush() -> None:
        k = len(manifest["shards"])
        path = out / f"shard_{k:04d}.pt"
        torch.save({
            "prompt_indices": [b[0] for b in buf], "sources": [items[b[0]][0] for b in buf],
            "tokens": [b[1] for b in buf], "num_prompt_tokens": [len(ids[b[0]]) for b in buf],
            "hidden": torch.cat([b[2] for b in buf]), "aux": torch.cat([b[3] for b in buf]) if layers else None,
        }, path)
        manifest["shards"].append({"file": path.name, "prompt_indices": [b[0] for b in buf],
                                   "num_tokens": sum(len(b[1]) for b in buf)})
        manifest_path.write_text(json.dumps(manifest, indent=1))
        buf.clear()

    for i, tokens, hid, aux in generate(engine, [ids[i] for i in keep], max_new_tokens=args.max_new_tokens,
                                        batch=args.batch, eos=tok.eos_token_id, hidden_layers=layers):
        if not torch.isfinite(hid).all() or (aux is not None and not torch.isfinite(aux).all()):
            raise RuntimeError(f"prompt {keep[i]}: a hidden state overflowed fp16; store float32 instead")
        buf.append((keep[i], tokens, hid, aux))
        n_tok += len(tokens)
        n_new += len(tokens) - len(ids[keep[i]])
        bar.update(1)
        dt = time.perf_counter() - t0
        bar.set_postfix_str(f"{n_new / dt:.1f} new tok/s, {n_tok / dt:.1f} tok/s")
        if len(buf) >= args.shard_size:
            flush()
    if buf:
        flush()
    bar.close()
    dt = time.perf_counter() - t0
    print(f"done: {n_new} generated tokens ({n_tok} with prompts) in {dt:.0f} s = {n_new / max(dt, 1e-9):.1f} "
          f"generated tok/s, {n_tok / max(dt, 1e-9):.1f} tok/s through the target; data in {out}", flush=True)


if __name__ == "__main__":
    main()
