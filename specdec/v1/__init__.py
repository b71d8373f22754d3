"""The serving engine, after vLLM v1: an engine core (scheduler + worker in a busy loop) talking to a
front end over msgspec messages.

- ``protocol.py``: the wire format (EngineCoreRequest, EngineCoreOutputs, ...);
- ``core.py``: ``EngineCore`` (one step -> EngineCoreOutputs) and its busy loop over ZeroMQ;
- ``client.py``: the clients (in-process, and a spawned process over ZeroMQ) with one interface;
- ``channel.py``: the spawned core's channel: private (a 0700 directory, one peer per socket, admitted by pid)
  and authenticated (CURVE keys or an HMAC made per launch), so another local process can't read, inject or kill;
- ``detokenizer.py`` / ``output_processor.py``: the front end's text work (incremental detokenizing, stop
  strings, parallel sampling's children) that overlaps the core's compute.

Tensors never cross: only token ids, numbers and strings do.
"""
