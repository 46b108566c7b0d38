"""Structured outputs: grammars that constrain what a request may generate.

``json_schema.py`` holds the rules a schema must pass before any compile (torch-free: the
router applies them too); ``backend.py`` compiles a ``StructuredOutputsParams`` with xgrammar
in the child processes of ``compile_worker.py`` (killed past their time limit) and makes the
per-request matcher; ``manager.py`` (``StructuredOutputManager``, owned by the engine core)
runs compiles off the step loop, caches compiled grammars and fills each step's token
bitmask; ``bitmask.py`` applies that bitmask to the logits, which the sampler does before
every other rule.
"""
