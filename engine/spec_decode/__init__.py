"""Speculative decoding: proposers of draft tokens, and their verification.

``proposer`` is the interface (and the one factory), ``ngram`` and ``draft_model`` the
proposers, ``rejection_sampler`` the acceptance rule that keeps the target's
distribution exactly, ``verify`` the runner's step over the draft positions.
"""
