"""The architecture, checked: the file-level import graph has no circle and never points from a lower layer to
a higher one; the step path asks its parts for capabilities through their interfaces (no getattr/hasattr
probes); nothing patches sys.path; a group's sequence is read through one helper.

An import counts wherever it is written (module level or inside a function: a lazy import is still an edge),
except under ``if TYPE_CHECKING:``; importing a package counts as importing its ``__init__``.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["specdec", "proposers", "scorers", "specdec_kernels"]

# Lowest first; a module may import only its own layer and the ones before it. A module belongs to the first
# layer whose prefix names it (the longest prefix wins).
LAYERS: list[tuple[str, ...]] = [
    ("specdec_kernels",),  # ops: a torch reference and a Triton kernel each
    ("specdec.engine",),  # the forward: model engines, KV cache, loaders
    ("specdec.heads",),  # draft-head networks and their checkpoints
    ("specdec.datamodel",),  # requests, sequences, per-step metadata, HiddenStates, outputs
    ("specdec.interfaces",),  # one step's contracts
    ("specdec.sampling",),  # sampler, logits processors, logprobs
    ("specdec.verify",),  # chain and tree verification
    ("specdec.core",),  # the step loop, scheduler, transactions, the plain worker
    ("specdec.spec_decode",),  # the speculative step, proposer contract, registry, builder
    ("specdec.reference",),  # the algorithm on one screen
    ("proposers", "scorers"),  # plug-ins (found by the registry by name, never imported by the core)
    ("specdec.entrypoints",),  # LLM, EngineArgs
    ("specdec.v1",),  # engine core process, AsyncLLMEngine
    ("specdec.experiment",),  # the experiment driver
    ("specdec.serve",),  # the HTTP server (composes its config through specdec.experiment.compose)
    ("specdec.vllm_compat", "specdec.run", "specdec.replay", "specdec.report", "specdec.__main__", "specdec"),
]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, level - 1 packages up
            pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = []
    for name in names:
        while name and name not in known:  # `import a.b.c` of a non-module attribute: its module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        type_only = {id(n) for node in ast.walk(tree)
                     if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                     for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in type_only:
                graph[module].update(_targets(module, path, node, known))
        graph.setdefault(module, set())
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py LAYERS: add it there"
    return best


def test_the_import_graph_has_no_circle():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():  # the check above can fail
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_points_up_the_layers():
    up = sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                for m, targets in import_graph().items() for t in targets if layer_of(t) > layer_of(m))
    assert up == [], "\n".join(up)


# the step path: every capability it needs is declared on the interface it belongs to (ModelEngine, Worker,
# SpeculativeVerifier, Proposer ...) with a default, so it reads attributes and never probes for them
STEP_PATH = ["specdec/core/llm_engine.py", "specdec/core/plain_worker.py", "specdec/core/scheduler.py",
             "specdec/core/transaction.py", "specdec/spec_decode/spec_decode_worker.py",
             "specdec/spec_decode/top1_proposer.py", "specdec/spec_decode/builder.py", "specdec/verify", "scorers"]


def _py_files(paths: list[str]) -> list[Path]:
    return [f for p in paths for f in ((ROOT / p).rglob("*.py") if (ROOT / p).is_dir() else [ROOT / p])]


def test_the_step_path_probes_no_capability():
    probes = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in _py_files(STEP_PATH)
              for i, line in enumerate(f.read_text().splitlines(), 1)
              if re.search(r"\b(getattr|hasattr)\(", line.split("#")[0])]
    assert probes == [], "\n".join(probes)


def test_nothing_patches_sys_path():
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in ROOT.rglob("*.py") if ".git" not in f.parts
            and f != Path(__file__).resolve()
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
            if re.search(r"sys\.path\.(insert|append|extend|remove)|sys\.path\s*(\+?=|\[)", line.split("#")[0])]
    assert hits == [], "\n".join(hits)


def test_a_groups_sequence_is_read_through_one_helper():
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in _py_files(PACKAGES + ["tests", "experiments"])
            for i, line in enumerate(f.read_text().splitlines(), 1) if re.search(r"next\(iter\([^)]*seq_data", line)]
    helper = [h for h in hits if h.startswith("specdec/datamodel/metadata.py:")]  # SequenceGroupMetadata.first_seq
    assert len(helper) == 1 and hits == helper, "\n".join(hits)
