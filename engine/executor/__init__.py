"""Executors: how the engine core's steps reach the workers that run the model.

``Executor`` is the interface, ``create_executor`` the one factory (it picks the
backend ``ParallelConfig.distributed_executor_backend`` names); backends live in their
own modules and are imported only when built (``uniproc``: one in-process worker;
``multiproc``: one worker process per rank).
"""

from __future__ import annotations

from tandem.engine.executor.abstract import EngineDeadError, Executor, create_executor

__all__ = ["EngineDeadError", "Executor", "create_executor"]
