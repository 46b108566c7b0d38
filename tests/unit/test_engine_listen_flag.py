"""``--listen`` of the engine commands is checked when the flags are parsed."""

from __future__ import annotations

import pytest

from tandem.contracts.role import Role
from tandem.services.common.server import build_parser


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "nonsense", "127.0.0.1:", "h:-1"])
def test_a_bad_listen_address_is_a_usage_error_naming_the_flag(listen: str, capsys) -> None:
    """Bug: `tandem prefill --listen 127.0.0.1:99999` served on port 34463 (gRPC took the
    port modulo 65536) and `--listen nonsense` died in a RuntimeError traceback after the
    model loaded."""
    with pytest.raises(SystemExit) as exc:
        build_parser("tandem prefill", Role.PREFILL).parse_args(["--listen", listen])
    assert exc.value.code == 2
    assert "argument --listen" in capsys.readouterr().err


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "0.0.0.0:50061", "[::]:65535"])
def test_good_listen_addresses_pass_through(listen: str) -> None:
    ns = build_parser("tandem prefill", Role.PREFILL).parse_args(["--listen", listen])
    assert ns.listen == listen
