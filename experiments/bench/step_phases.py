"""Where a speculative step's time goes outside the forward: ``python -m specdec.run`` with a timer around each piece.

    python -m experiments.bench.step_phases +experiment=eagle measure_baseline=false proposer.speculation_policy=static
    python -m experiments.bench.step_phases +experiment=ngram_goodput measure_baseline=false "dataset.categories=[rag]"

Every argument goes to ``specdec.run`` (Hydra overrides). The methods in ``PIECES`` are wrapped with a perf_counter
timer (~1 us each); at exit the total of each, divided by the number of speculative steps, is printed in
microseconds, largest first, with its call count. Pieces nest (``_spec_step`` holds ``score_proposals`` holds the
engine's ``forward``), and ``execute_model`` also counts prefill steps. Figures are for comparing two revisions or
configurations in one sitting; the run's own summary.json is unchanged by the timers.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import runpy
import sys
import time

PIECES = [  # (module, qualified name)
    ("specdec.core.llm_engine", "LLMEngine.step"),
    ("specdec.spec_decode.spec_decode_worker", "SpecDecodeWorker.execute_model"),
    ("specdec.spec_decode.spec_decode_worker", "SpecDecodeWorker._spec_step"),
    ("specdec.spec_decode.spec_decode_worker", "SpecDecodeWorker._choose"),
    ("specdec.spec_decode.spec_decode_worker", "SpecDecodeWorker._verify"),
    ("specdec.spec_decode.spec_decode_worker", "SpecDecodeWorker.commit"),
    ("specdec.spec_decode.spec_decode_worker", "SpecDecodeWorker._observe"),
    ("specdec.spec_decode.top1_proposer", "Top1Proposer.get_spec_proposals"),
    ("specdec.verify.chain", "_Verifier.verify_proposals"),  # a chain's verification (its small greedy path: lists)
    ("specdec.spec_decode.spec_decode_worker", "emitted_logprobs"),  # inside commit: each emitted token's logprob
    ("specdec.engine.native", "NativeEngine.forward"),
    ("specdec.engine.cpu.stack", "NativeStack.forward"),  # the layers (and the final norm)
    ("specdec.engine.cpu.stack", "NativeStack.logits_stats"),  # the LM head with its fused row statistics
    ("specdec.heads.draft_call", "NativeDraftTree.__call__"),
    ("proposers.eagle", "EagleProposer.propose_tree"),
    ("proposers.eagle", "EagleProposer._catch_up_rows"),
    ("proposers.ngram", "NGramProposer.propose"),
    ("proposers.ngram_branch", "NGramBranch.chains"),
    ("scorers.tree", "TreeScorer.score_proposals"),
    ("scorers.tree", "tree_batch"),
    ("scorers.mqa", "MQAScorer.score_proposals"),
    ("scorers.mqa", "scores_from_rows"),
    ("scorers.tree", "scores_from_rows"),  # (the tree scorer calls its own imported name)
]

_total: dict[str, float] = collections.defaultdict(float)
_calls: collections.Counter = collections.Counter()


def wrap(module: str, qual: str) -> None:
    """Replace ``module.qual`` by a timed wrapper (modules that import the name before this ran keep the original)."""
    owner = importlib.import_module(module)
    *path, name = qual.split(".")
    for p in path:
        owner = getattr(owner, p)
    fn, key = getattr(owner, name), f"{module.rsplit('.', 1)[-1]}.{qual}"

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _total[key] += time.perf_counter() - t
            _calls[key] += 1

    setattr(owner, name, timed)


def report() -> None:
    steps = _calls.get("spec_decode_worker.SpecDecodeWorker._spec_step", 0)
    print(f"per speculative step (n={steps}), us:")
    for key, s in sorted(_total.items(), key=lambda kv: -kv[1]):
        print(f"  {key:55s} {s / max(steps, 1) * 1e6:9.1f}  calls {_calls[key]}")


def main() -> None:
    for module, qual in PIECES:
        wrap(module, qual)
    atexit.register(report)
    sys.argv = ["specdec.run", *sys.argv[1:]]
    runpy.run_module("specdec.run", run_name="__main__")


if __name__ == "__main__":
    main()
