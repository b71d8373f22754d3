"""experiments/bench/policy_overhead.py on the tiny model: both parts run, the phases are timed, and every config of
the saturated part emits plain decoding's tokens. Figures for experiments/LOG.md come from SmolLM2, not from here."""

from experiments.bench.policy_overhead import PHASES, PhaseTimer, main


def test_the_bench_runs_and_never_changes_the_tokens(capsys):
    res = main(["--model", "tiny-random-llama", "--batches", "1,3", "--tokens", "8", "--saturate", "5", "--reps", "2",
                "--threads", "1"])
    text = capsys.readouterr().out
    assert "batch 1: policy" in text and "batch 3: policy" in text and "| never |" in text
    for B in (1, 3):
        r = res["overhead"][B]
        assert r["decode_steps"] > 0 and r["policy_ms_per_step"] > 0
    assert set(res["saturated"]) == {"plain", "never", "goodput"}
    assert all(r["same_tokens"] for rs in res["saturated"].values() for r in rs if r["same_tokens"] is not None)
    assert sum(r["same_tokens"] is not None for rs in res["saturated"].values() for r in rs) >= 5


def test_the_timer_restores_the_worker_and_the_policy():
    from specdec.spec_decode.policy import GoodputPolicy
    from specdec.spec_decode.spec_decode_worker import SpecDecodeWorker

    owner = {n: GoodputPolicy if n == "reuses_zeros" else SpecDecodeWorker for n in PHASES}
    before = {n: getattr(owner[n], n) for n in PHASES}
    with PhaseTimer():
        assert all(getattr(owner[n], n) is not before[n] for n in PHASES)
    assert all(getattr(owner[n], n) is before[n] for n in PHASES)
