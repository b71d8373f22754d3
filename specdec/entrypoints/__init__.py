"""The offline entry points (after ``vllm.entrypoints``): ``llm`` (the ``LLM`` class) and ``engine_args``
(``EngineArgs``: everything that builds an engine). The online ones are specdec/v1 (engine core process,
``AsyncLLMEngine``) and specdec/serve (the OpenAI-compatible HTTP server).
"""
