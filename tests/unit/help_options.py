"""The options an argparse ``--help`` text lists, read from the text as a user sees it.

Shared by the Helm chart tests (the chart's args against the real `tandem <role> --help`)
and the flag-set pins (tests/unit/test_cli_flag_sets.py).
"""

from __future__ import annotations

import re

_OPTION_LINE = re.compile(r"^\s{1,6}(-{1,2}[A-Za-z0-9].*)$")


def help_options(help_text: str) -> dict[str, str]:
    """Option string (``--flag``, ``-f``) -> what follows it in ``help_text``: its metavar
    or ``{a,b}`` choices, ``""`` for a switch; ``-h`` / ``--help`` left out."""
    out: dict[str, str] = {}
    for line in help_text.splitlines():
        match = _OPTION_LINE.match(line)
        if not match:
            continue
        # argparse: "--flag METAVAR, -f METAVAR   help"; the help text follows 2+ spaces.
        invocation = re.split(r"\s{2,}", match.group(1).strip())[0]
        for part in invocation.split(", "):
            tokens = part.split()
            if tokens and tokens[0].startswith("-"):
                out[tokens[0]] = " ".join(tokens[1:])
    out.pop("-h", None)
    out.pop("--help", None)
    return out
