"""`switchyard serve`'s plan: the gateway process count (N > 1 only with a Redis store)."""
from __future__ import annotations

import pytest

from gateway.ops.supervisor import parse_plan


def test_gateway_workers_default_to_auto_and_need_redis_above_one(tmp_path) -> None:
    assert parse_plan([]).gateway_workers is None
    with pytest.raises(SystemExit, match="redis_url"):
        parse_plan(["--gateway-workers", "2"])
    config = tmp_path / "serve.yaml"
    config.write_text("gateway: {redis_url: 'redis://127.0.0.1:6379/0'}\n")
    assert parse_plan(["--config", str(config), "--gateway-workers", "2"]).gateway_workers == 2


def test_kv_store_is_off_unless_asked(tmp_path) -> None:
    assert parse_plan([]).kv_store is False
    assert parse_plan(["--kv-store"]).kv_store is True
    config = tmp_path / "serve.yaml"
    config.write_text("kv_store: true\n")
    assert parse_plan(["--config", str(config)]).kv_store is True
