"""KV block store: UCX data plane (ucxx), Redis metadata index.

Modules: ``keys`` (BlockKey, LayoutFingerprint), ``store`` (the BlockStore
interface and errors), ``client`` (what the engine's connector uses), ``server``
(`tandem kvstore`), ``pool`` (slots, LRU), ``index`` (Redis schema),
``protocol`` (wire messages), ``ucx`` (the seam to ucxx), ``metrics``.
Nothing is imported here, so importing a key type never loads UCX or Redis.
"""
