"""The `switchyard` console script: `gateway --config FILE`, `worker ...`, `compress ...`, `serve ...`.

`worker` and `compress` exec the backend modules in a fresh interpreter, so the gateway process
never imports `backends`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config.gateway_config import GatewayConfig


def _exec_module(module: str, args: Sequence[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def gateway_parser() -> argparse.ArgumentParser:
    """`switchyard gateway`'s flags (docker/compose.yaml's command lines are checked against it)."""
    parser = argparse.ArgumentParser(prog="switchyard gateway", description="Run the OpenAI-compatible gateway.")
    parser.add_argument("--config", required=True, help="YAML config file (see docs/configuration.md)")
    parser.add_argument("--workers", type=_workers_arg, default=1, metavar="N|auto",
                        help="processes serving the port (SO_REUSEPORT); N > 1 needs redis_url. auto: the "
                             "cores, at most 4, with redis_url; 1 without (default: 1)")
    parser.add_argument("--check", action="store_true",
                        help="check the config (as start-up does, without the network) and exit: 0 if it is good")
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # one of --workers N
    return parser


def _run_gateway(args: Sequence[str]) -> None:
    options = gateway_parser().parse_args(args)
    import signal
    signal.signal(signal.SIGHUP, signal.SIG_IGN)   # until serve (or the --workers parent) handles it: not fatal
    from gateway.config.gateway_config import ConfigError, load_config
    from gateway.ops.gateway_processes import WorkersError, resolve_workers, run_workers
    from gateway.telemetry.tracing import configure_logging
    try:
        config = load_config(options.config)
        num_workers = resolve_workers(options.workers, config.redis_url)
    except (ConfigError, WorkersError) as exc:
        raise SystemExit(f"switchyard gateway: {exc}") from None
    if options.check:
        _check(config)
        return
    configure_logging(config.log_level, json_lines=config.log_format == "json")
    if num_workers > 1 and not options.reuse_port:
        raise SystemExit(run_workers(options.config, num_workers, config.drain_timeout_s))
    import uvloop

    from gateway.app import serve
    try:
        uvloop.run(serve(config, reuse_port=options.reuse_port, config_path=options.config))
    except KeyboardInterrupt:
        pass
    except ConfigError as exc:  # a provider kind's own checks run when the app is built
        raise SystemExit(f"switchyard gateway: {exc}") from None


def _check(config: GatewayConfig) -> None:
    """What start-up checks before it serves (the provider kinds' and policies' own checks included)."""
    from gateway.app import create_app
    from gateway.config.discovery import is_discovered
    from gateway.config.gateway_config import ConfigError
    try:
        create_app(config)
    except ConfigError as exc:
        raise SystemExit(f"switchyard gateway: {exc}") from None
    urls = {url for p in config.providers.values() for pool in p.pools().values() for url in pool}
    names = sum(1 for url in urls if is_discovered(url))
    print(f"config OK: {len(config.models)} models, {len(config.providers)} providers, {len(urls) - names} "
          f"endpoints and {names} DNS names, {len(config.api_keys)} API keys")


def _workers_arg(value: str) -> int | None:
    """`--workers N` or `--workers auto` (None: resolved from the config)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None


def _run_serve(args: Sequence[str]) -> None:
    importlib.import_module("gateway.ops.supervisor").main(args)  # the all-in-one launcher, imported lazily


_COMMANDS: Mapping[str, Callable[[Sequence[str]], None]] = MappingProxyType({
    "gateway": _run_gateway,
    "worker": lambda args: _exec_module("backends.server", args),
    "compress": lambda args: _exec_module("tools.compress", args),
    "make-draft": lambda args: _exec_module("tools.draft_training.make_draft", args),
    "train-draft": lambda args: _exec_module("tools.draft_training.train_draft", args),
    "serve": _run_serve,
})


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _COMMANDS:
        raise SystemExit(f"usage: switchyard {{{','.join(_COMMANDS)}}} ...")
    _COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
