"""Prompt sets for experiments: Spec-Bench (vendored), plain jsonl files, and the held-out prompts of the
distillation pools (``data/distill``). No model, no tokenizer.

A jsonl file is read row by row: blank lines are skipped, a malformed or incomplete row is an error
naming the file and line, and a file (or a selection) with no prompts is an error, never an empty run.
"""

from __future__ import annotations

import gzip
import json
from importlib.resources import files
from pathlib import Path

import msgspec

SPEC_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",  # MT-bench
    "translation", "summarization", "qa", "math_reasoning", "rag",
)
MT_BENCH_CATEGORIES = SPEC_BENCH_CATEGORIES[:8]
# the rows of Spec-Bench's report (evaluation/speed.py): MT-bench's 8 categories pooled, then one task each
SPEC_BENCH_TASKS = {"mt_bench": MT_BENCH_CATEGORIES, **{c: (c,) for c in SPEC_BENCH_CATEGORIES[8:]}}


class Prompt(msgspec.Struct, kw_only=True):
    question_id: str  # stable id from the source file
    category: str  # Spec-Bench category, or "default" for plain jsonl
    turns: list[str]  # user turns; MT-bench questions have two


def spec_bench_path() -> Path:
    return Path(str(files("specdec").joinpath("assets", "spec_bench_question.jsonl")))


def load_spec_bench(
    categories: list[str] | str | None = None,
    per_category: int | None = None,
    path: str | None = None,
) -> list[Prompt]:
    """Spec-Bench questions, in file order, keeping at most ``per_category`` of each chosen category.

    ``categories``: None/'all' = all 13, 'mt_bench' = MT-bench's 8, or a list of names.
    """
    wanted = _choose(categories, SPEC_BENCH_CATEGORIES)
    unknown = [c for c in wanted if c not in SPEC_BENCH_CATEGORIES]
    if unknown:
        raise ValueError(f"unknown Spec-Bench categories {unknown}; choose from {list(SPEC_BENCH_CATEGORIES)}, "
                         "'all' or 'mt_bench'")
    src = Path(path) if path else spec_bench_path()
    if not src.exists():
        raise FileNotFoundError(f"Spec-Bench file {src} not found; set dataset.path to a question.jsonl")
    taken: dict[str, int] = {}
    out = []
    for where, row in read_jsonl(src):
        cat, turns = _field(row, "category", str, where), _field(row, "turns", list, where)
        if "question_id" not in row:
            raise ValueError(f"{where}: no 'question_id' (fields: {sorted(row)})")
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings, got {turns!r:.80}")
        if cat not in wanted or (per_category is not None and taken.get(cat, 0) >= per_category):
            continue
        taken[cat] = taken.get(cat, 0) + 1
        out.append(Prompt(question_id=str(row["question_id"]), category=cat, turns=list(turns)))
    if not out:
        raise ValueError(f"Spec-Bench file {src}: no prompts selected (categories={wanted}, "
                         f"per_category={per_category}); widen the selection")
    return out


def load_jsonl_prompts(path: str, field: str = "prompt", limit: int | None = None) -> list[Prompt]:
    """A plain jsonl file: one object per line with the prompt text under ``field``."""
    out = []
    for where, row in read_jsonl(Path(path)):
        if limit is not None and len(out) >= limit:
            break
        if field not in row:
            raise KeyError(f"{where} has no field {field!r} (fields: {sorted(row)}); set dataset.field")
        text = _field(row, field, str, where)
        if not text:
            raise ValueError(f"{where}: field {field!r} is empty; every row needs a prompt")
        out.append(Prompt(question_id=str(row.get("id", len(out))), category="default", turns=[text]))
    if not out:
        raise ValueError(f"{path}: no prompts (limit={limit}); a dataset needs at least one row")
    return out


REPO = Path(__file__).resolve().parents[2]
DISTILL_HELDOUT_EVERY = 20  # train_eagle*.py hold out the prompts whose id is a multiple of 1 / --val-frac (0.05)


def load_distill_heldout(
    path: str = "data/distill",
    categories: list[str] | str | None = "mt_bench",
    per_category: int | None = 2,
    every: int = DISTILL_HELDOUT_EVERY,
) -> list[Prompt]:
    """The held-out prompts of a distillation pool: the heads' own training distribution, never trained on.

    ``path`` holds ``prompts.jsonl.gz`` (``data/distill``, or ``data/distill/magpie``); a relative path is read
    from the working directory, else from the repository. Kept: single-user-turn prompts whose ``id`` is a
    multiple of ``every`` (the training scripts' held-out split), in pool order (a weighted random order, so a
    prefix is a fair sample), at most ``per_category`` of each category. ``categories``: 'mt_bench' = the
    pool's categories that MT-bench has (writing ... humanities), None/'all' = every category, or a list.
    Run as ``python -m specdec.run +experiment=eagle dataset=distill_heldout``: tau on in-distribution text.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every={every!r} must be a positive int (the training scripts hold out every "
                         f"{DISTILL_HELDOUT_EVERY}th prompt)")
    base = Path(path).expanduser()
    if not base.exists() and not base.is_absolute() and (REPO / base).exists():
        base = REPO / base
    src = base / "prompts.jsonl.gz" if base.is_dir() else base
    if not src.is_file():
        raise FileNotFoundError(f"distillation pool {src} not found; set dataset.path to a folder holding "
                                "prompts.jsonl.gz (data/distill or data/distill/magpie)")
    with gzip.open(src, "rt", encoding="utf-8") as f:
        rows = [(f"{src}:{n}", json.loads(line)) for n, line in enumerate(f, start=1) if line.strip()]
    present = sorted({_field(r, "category", str, w) for w, r in rows})
    wanted = _choose(categories, present)
    unknown = [c for c in wanted if c not in present]
    if unknown or not wanted:
        raise ValueError(f"categories {unknown or categories!r} are not in {src}; it has {present}, or say "
                         "'all' / 'mt_bench'")
    taken: dict[str, int] = {}
    out = []
    for where, row in rows:
        pid, cat = _field(row, "id", int, where), row["category"]
        msgs = _field(row, "messages", list, where)
        if pid % every or cat not in wanted or len(msgs) != 1 or msgs[0].get("role") != "user":
            continue
        if per_category is not None and taken.get(cat, 0) >= per_category:
            continue
        taken[cat] = taken.get(cat, 0) + 1
        out.append(Prompt(question_id=str(pid), category=cat, turns=[_field(msgs[0], "content", str, where)]))
    if not out:
        raise ValueError(f"{src}: no held-out prompts selected (categories={wanted}, per_category={per_category}, "
                         f"every={every}); widen the selection")
    return out


def read_jsonl(path: Path):
    """Yield ("file:line", object) for every non-blank line; a bad line raises naming file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} not found")
    empty = True
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            empty = False
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                                 "JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object; each line must be one "
                                 "JSON object")
            yield where, row
    if empty:
        raise ValueError(f"dataset file {path} is empty; it needs one JSON object per line")


def _choose(categories: list[str] | str | None, present) -> list[str]:
    """None/'all' = every category present, 'mt_bench' = MT-bench's categories among them, else the names given."""
    if categories is None or categories == "all":
        return list(present)
    if categories == "mt_bench":
        return [c for c in MT_BENCH_CATEGORIES if c in present]
    return [categories] if isinstance(categories, str) else list(categories)


def _field(row: dict, name: str, kind: type, where: str):
    if name not in row:
        raise ValueError(f"{where}: no {name!r} (fields: {sorted(row)})")
    if not isinstance(row[name], kind):
        raise ValueError(f"{where}: {name!r} must be a {kind.__name__}, got {type(row[name]).__name__}")
    return row[name]
