"""The stop rule: whether a request's latest output token finishes it.

One definition for every place that decides it: the scheduler after each sampled
token (a ``prefill_only`` request's token 1 included, which the prefill engine then
reports in its output's finish reason), and the decode service for output token 1
(which it receives as ``first_token_id``, so it may not ask its own scheduler).

Order of the rules: EOS, then a stop token id, both only once more than
``min_tokens`` tokens were generated; then the length caps (``max_tokens``, or
the sequence filling ``max_seq_len``). NOTE: a token that is both EOS (or a stop
id) and the last one allowed finishes as "stop", not "length" (vLLM v1 tests the
length first); tandem has always reported it so.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class Stop:
    """Why a request finished.

    Attributes:
        status: ``FINISHED_STOPPED`` (EOS or a stop token id) or
            ``FINISHED_LENGTH_CAPPED`` (``max_tokens`` or the context is full).
        stop_reason: the stop token id that matched, else ``None`` (EOS and length
            stops carry none, as in vLLM).
    """

    status: RequestStatus
    stop_reason: int | None = None

    @property
    def finish_reason(self) -> str:
        """OpenAI ``finish_reason``: "stop" or "length"."""
        reason = RequestStatus.finish_reason(self.status)
        assert reason is not None, f"{self.status.name} is not a finished status"
        return reason


def check_stop(request: Request, max_seq_len: int) -> Stop | None:
    """Whether ``request`` is finished by its last output token; mutates nothing.

    Args:
        request: a request with at least one output token; its ``eos_token_id``,
            ``sampling_params`` (``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
            ``max_tokens``) and token counts are read.
        max_seq_len: most tokens (prompt + output) a sequence may hold: the context
            length capped by the KV cache's capacity (``Scheduler.max_seq_len``).

    Returns:
        The ``Stop`` to apply, or ``None`` when the request goes on.
    """
    assert request.output_token_ids, f"{request.request_id} has no output token to check"
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens > params.min_tokens:
        if not params.ignore_eos and token == request.eos_token_id:
            return Stop(RequestStatus.FINISHED_STOPPED)
        if token in params.stop_token_ids:
            return Stop(RequestStatus.FINISHED_STOPPED, stop_reason=token)
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return Stop(RequestStatus.FINISHED_LENGTH_CAPPED)
    if request.num_tokens >= max_seq_len:
        return Stop(RequestStatus.FINISHED_LENGTH_CAPPED)
    return None
