"""The step loop and what it owns, independent of how a step is computed: ``llm_engine`` (admit, step,
append, stop, free), ``scheduler`` (FCFS continuous batching), ``transaction`` (a step is undone if it
raises), ``validate`` (checks at the door), ``plain_worker`` (one target forward and one sample per
sequence: what the speculative worker in specdec/spec_decode falls back to), ``parallel`` (n children),
``prompt_logprobs``, ``detokenizer``. Imports no proposer, scorer, experiment or entry point.
"""
