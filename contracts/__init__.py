"""Contracts: the values that cross process boundaries, owned by no single part.

Engine, KV store, services and router all import from here, and this package imports none
of them (only the standard library, numpy, the generated ``tandem.v1`` messages and the
engine's plain value types), so no part reaches into another part's internals for a shared
definition. Nothing is imported here: importing one contract never loads torch or a client.
"""
