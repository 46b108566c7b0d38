"""``n > 1``: one request becomes ``n`` single-completion children, one scheme everywhere.

The offline ``LLMEngine`` and the router both fan out with :func:`fan_out`, so a child's
id and seed are the same whichever path ran it (logs, metrics and reproducible seeds
line up). Parallel sampling in vLLM is built the same way (children with ``n = 1``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tandem.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChildRequest:
    """One of a request's ``n`` completions.

    Attributes:
        index: 0..n-1, the completion's index (OpenAI ``choices[].index``).
        request_id: the parent's id for ``n == 1``, else :func:`child_request_id`.
        sampling_params: the parent's with ``n = 1`` and, when seeded, ``seed + index``
            (the children's samples differ but stay reproducible).
    """

    index: int
    request_id: str
    sampling_params: SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    """Id of child ``index`` of a request with ``n > 1``: ``f"{request_id}-{index}"``."""
    return f"{request_id}-{index}"


def fan_out(request_id: str, params: SamplingParams) -> list[ChildRequest]:
    """The ``params.n`` children of a request, in index order.

    Args:
        request_id: the parent's id.
        params: the parent's validated sampling parameters.

    Returns:
        ``params.n`` children; a request with ``n == 1`` keeps its own id.
    """
    return [
        ChildRequest(
            index=i,
            request_id=request_id if params.n == 1 else child_request_id(request_id, i),
            sampling_params=dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i
            ),
        )
        for i in range(params.n)
    ]
