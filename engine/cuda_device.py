"""The CUDA device an engine runs on, made the current device for its work.

PyTorch's own operators follow their tensors' device, but two things follow the calling
thread's *current* CUDA device instead: a Triton launch (the stream and device it
launches on) and a CUDA graph capture (the stream it captures on, and the device its
memory pool belongs to). Every thread starts on device 0 and only
``torch.cuda.set_device`` (or the ``torch.cuda.device`` context) changes that; so an
engine on ``cuda:1`` stepped from a thread that never switched launched its Triton
kernels on GPU 0 with GPU 1's pointers. The model runner therefore runs every call that
touches the GPU (model load, memory profile, KV cache allocation and graph capture,
each step) under :func:`on_device` of its own index, whichever thread calls it (the
offline ``LLM``'s caller, a service's engine thread, a worker process's main thread).
The context is restored afterwards, so engines on different devices can share a thread.

:func:`cuda_device_index` decides the index from plain values and is unit-tested on the
CPU; :func:`resolve_cuda_index` feeds it this process's CUDA facts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypeVar

import torch


def cuda_device_index(device: str, current_device: int, device_count: int) -> int | None:
    """The CUDA device index an engine on ``device`` runs on.

    Args:
        device: the engine's device string ("cpu", "cuda" or "cuda:N").
        current_device: the calling thread's current CUDA device (what a bare "cuda"
            means: PyTorch's own rule for ``torch.device("cuda")``).
        device_count: CUDA devices visible to this process.

    Returns:
        ``None`` for a device that is not CUDA, else the index in ``[0, device_count)``.

    Raises:
        ValueError: naming ``device``: not a torch device string, no visible CUDA device,
            or an index outside ``[0, device_count)``.
    """
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a device (cpu, cuda or cuda:N)") from exc
    if dev.type != "cuda":
        return None
    if device_count < 1:
        raise ValueError(f"device {device!r} requested but no CUDA device is visible")
    index = current_device if dev.index is None else dev.index
    if not 0 <= index < device_count:
        raise ValueError(
            f"device {device!r}: CUDA device {index} does not exist; this process sees "
            f"{device_count} (cuda:0..cuda:{device_count - 1}; CUDA_VISIBLE_DEVICES renumbers)"
        )
    return index


def resolve_cuda_index(device: str | torch.device) -> int | None:
    """:func:`cuda_device_index` with this process's CUDA facts, read only for a CUDA
    device (no CUDA call for "cpu").

    Raises:
        ValueError: naming ``device``: CUDA requested but unavailable, or as
            :func:`cuda_device_index`.
    """
    text = str(device)
    if torch.device(text).type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"device {text!r} requested but CUDA is not available")
    return cuda_device_index(text, torch.cuda.current_device(), torch.cuda.device_count())


def on_device(index: int | None) -> AbstractContextManager[Any]:
    """A context in which CUDA device ``index`` is the calling thread's current device
    (the previous one restored on exit); nothing for ``None`` (the CPU)."""
    return nullcontext() if index is None else torch.cuda.device(index)


class _HasCudaIndex(Protocol):
    cuda_index: int | None


Method = TypeVar("Method", bound=Callable[..., Any])


def runs_on_own_device(method: Method) -> Method:
    """Decorate a method of an object with a ``cuda_index`` attribute: the method runs
    under :func:`on_device` of that index."""

    @functools.wraps(method)
    def wrapper(self: _HasCudaIndex, *args: Any, **kwargs: Any) -> Any:
        with on_device(self.cuda_index):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
