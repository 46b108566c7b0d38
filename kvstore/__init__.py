"""KV block store: UCX data plane (ucxx), Redis metadata index.

Modules: ``keys`` (BlockKey, LayoutFingerprint), ``store`` (the BlockStore
interface and errors), ``client`` (the synchronous client the engine's connector
uses) over ``aio_client`` (its coroutines) and ``transport`` (one node connection),
``server`` (`tandem kvstore`: flags, HTTP, main) over ``node`` (request handlers),
``config``, ``pool`` (slots, LRU), ``index`` (Redis schema), ``protocol`` (wire
messages), ``ucx`` (the seam to ucxx), ``shm`` (same-host reads from the node's
shared-memory pool), ``metrics``.
Nothing is imported here, so importing a key type never loads UCX or Redis.
"""
