"""The stop rule (engine/stop.py): one definition for the scheduler and the services."""

from __future__ import annotations

import pytest

from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.stop import Stop, check_stop

EOS = 2
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED


def request_with(outputs: list[int], prompt_len: int = 4, **params) -> Request:
    req = Request("r", list(range(10, 10 + prompt_len)),
                  SamplingParams(**({"max_tokens": 16} | params)), eos_token_id=EOS)
    for tok in outputs:
        req.append_output_token(tok)
    return req


@pytest.mark.parametrize(
    ("outputs", "params", "max_seq_len", "want"),
    [
        ([5], {}, 100, None),
        ([EOS], {}, 100, Stop(STOPPED)),
        ([EOS], {"ignore_eos": True}, 100, None),
        ([EOS], {"min_tokens": 1}, 100, None),
        ([5, EOS], {"min_tokens": 1}, 100, Stop(STOPPED)),
        ([9], {"stop_token_ids": [9]}, 100, Stop(STOPPED, stop_reason=9)),
        ([9], {"stop_token_ids": [9], "min_tokens": 1}, 100, None),
        ([EOS], {"stop_token_ids": [EOS]}, 100, Stop(STOPPED)),  # EOS first: no stop_reason
        ([EOS], {"stop_token_ids": [EOS], "ignore_eos": True}, 100, Stop(STOPPED, EOS)),
        ([5], {"max_tokens": 1}, 100, Stop(LENGTH)),
        ([5], {"max_tokens": None}, 100, None),
        ([EOS], {"max_tokens": 1}, 100, Stop(STOPPED)),  # a stop beats the length cap
        ([5], {}, 5, Stop(LENGTH)),  # prompt 4 + 1 output fills max_seq_len 5
        ([5], {}, 6, None),
        ([EOS], {"min_tokens": 1, "max_tokens": 1}, 100, Stop(LENGTH)),
    ],
)
def test_check_stop_cases(outputs, params, max_seq_len, want) -> None:
    req = request_with(outputs, **params)
    assert check_stop(req, max_seq_len) == want
    assert req.status == RequestStatus.WAITING and req.stop_reason is None, "mutates nothing"


def test_finish_reason_names() -> None:
    assert Stop(STOPPED).finish_reason == "stop"
    assert Stop(LENGTH).finish_reason == "length"


def test_no_eos_id_never_stops_on_eos() -> None:
    req = request_with([EOS])
    req.eos_token_id = None
    assert check_stop(req, 100) is None
