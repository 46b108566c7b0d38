"""Structured outputs: grammars that constrain what a request may generate.

``backend.py`` compiles a ``StructuredOutputsParams`` with xgrammar and makes the per-request
matcher; ``manager.py`` (``StructuredOutputManager``, owned by the engine core) compiles off
the step loop on a thread pool, caches compiled grammars and fills each step's token bitmask.
The sampler applies that bitmask to the logits before every other rule
(``engine.sampler.apply_token_bitmask``).
"""
