"""gateway/cli.py: bad invocations exit with a usage line or the config error."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize(("argv", "message"), [
    ([], "usage: switchyard"),
    (["frobnicate"], "usage: switchyard"),
    (["gateway", "--config", "/nonexistent/gateway.yaml"], "cannot read config"),
])
def test_cli_rejects_bad_invocations(argv: list[str], message: str) -> None:
    from gateway.cli import main

    with pytest.raises(SystemExit, match=message):
        main(argv)
