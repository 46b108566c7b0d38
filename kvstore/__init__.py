"""KV block store: UCX data plane (ucxx), Redis metadata index.

Modules: ``connector`` (the engine's "store" KV connector), ``store`` (the
BlockStore interface and errors), ``client`` (the synchronous client the connector
uses) over ``aio_client`` (its coroutines) and ``transport`` (one node connection),
``server`` (`tandem kvstore`: flags, HTTP, main) over ``node`` (request handlers),
``config``, ``pool`` (slots, LRU), ``index`` (Redis schema), ``protocol`` (wire
messages), ``ucx`` (the seam to ucxx), ``shm`` (same-host reads from the node's
shared-memory pool), ``metrics``.
Block keys and the KV layout are contracts (``tandem.contracts``). Nothing is imported
here, so importing one module never loads UCX or Redis.
"""
