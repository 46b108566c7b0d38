"""KV block store: UCX data plane (ucxx), Redis metadata index.

Modules: ``connector`` (the engine's "store" KV connector), ``store`` (the BlockStore
interface and errors), ``client`` (the blocking client the engine's connector
uses) over ``aio_client`` (its async core: index, registry, puts), which reads
through one reader per transport: ``shm_read`` (nodes on this host: their
shared-memory pool, ``shm``, pinned over the control socket ``shm_ctl``) and
``ucx_read`` (any node: UCX tag messages); ``transport`` (node connections and
records), ``buffers`` (checks of keys and buffers), ``server`` (`tandem kvstore`:
flags, HTTP, main) over ``node`` (request handlers), ``config`` (node, client and
UCX settings, read once at the edge), ``pool`` (slots, LRU), ``index`` (Redis
schema), ``lookup`` (index-only lookups for the connector and the router), ``protocol``
(wire messages), ``ucx`` (the seam to ucxx), ``metrics``.
Block keys and the KV layout are contracts (``tandem.contracts``). Nothing is imported
here, so importing one module never loads UCX or Redis.
"""
