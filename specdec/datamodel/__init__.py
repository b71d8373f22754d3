"""The data model (after the seed's ``vllm.sequence``), layered, each module importing only the ones before it:
``sampling_params`` (per-request knobs) -> ``sequence`` (tokens, statuses, ``RequestMetrics``, ``Sequence``,
``SequenceGroup``) -> ``metrics`` (pure functions over the counters) -> ``metadata`` (what the scheduler hands
the worker each step) -> ``hidden_states`` (``HiddenStates``, ``ExecuteModelRequest``); ``outputs`` (what
``LLM.generate`` returns) and ``inputs`` (prompt forms). Plain data; knows nothing about models or steps.
"""
