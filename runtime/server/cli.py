"""`kvpilot serve`: the engine flags plus the server's own; bad values fail with one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvpilot.runtime.args import add_engine_arguments
from kvpilot.runtime.tunables import BY_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "kvpilot serve runs two processes: this one (HTTP, chat templates, tokenising, detokenising and "
        "stop strings, streaming) and the engine core, which runs the step loop (and, with "
        "--tensor-parallel-size N, starts the N-1 other workers). They exchange per-step messages over "
        "local ZeroMQ sockets. If the core dies, every open request ends with an engine_dead error and "
        "/health answers 503 at once; the core exits when this process does. SIGTERM drains: new "
        "requests get 503 while admitted ones finish (--drain-timeout).")
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env KVPILOT_API_KEY)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys with their tenants, one 'KEY TENANT' pair per line (# comments): /v1/* then "
                        "requires one of them (or --api-key, whose tenant is 'default'), and a request's tenant "
                        "for --scheduler-policy fair and the per-tenant metrics is its key's, whatever its `user` "
                        "field says; without the file the tenant is `user`, else 'default'")
    g.add_argument("--admin-token", default=None,
                   help="token for /admin/config and /reload (default: env KVPILOT_ADMIN_TOKEN); unset disables them")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    g.add_argument("--metric-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between stats lines in the log")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long admitted requests may take to finish before they are aborted")
    g.add_argument("--allowed-model-root", default=None, help="the folder /reload may load models from")
    g.add_argument("--max-request-body-bytes", type=int, default=8 << 20, metavar="BYTES",
                   help="larger request bodies get 413 before they are read into memory or parsed (default 8 MiB)")
    g.add_argument("--header-read-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="close a connection whose request line and headers are not in within this time")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent in a chat request (in a sandboxed child process, stopped "
                        "after 2 s); without it such requests get 400 and only the model's template is used")
    g.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (off: the schema lists the admin routes)")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--tuned-config", default=None, metavar="FILE",
                   help=f"JSON object of live tunables ({', '.join(BY_NAME)}) that override their flags at "
                        "start; a missing file is ignored (the operator mounts the config it tuned the other pods to here)")


def run(args: argparse.Namespace) -> int:
    from kvpilot.runtime.startup import StartupLog, starting_phase

    startup = StartupLog("api", [starting_phase("interpreter", "api")])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvpilot.runtime.args import EngineArgs
    from kvpilot.runtime.caches import ensure_writable_caches
    from kvpilot.runtime.model_source import ModelSourceError

    ensure_writable_caches()

    try:
        engine_args = EngineArgs.from_cli(args)
        if args.tuned_config:
            engine_args = engine_args.with_tuned_config(args.tuned_config)
        with startup.phase("config"):  # the model resolved (a GGUF file converted once)
            engine_config = engine_args.create_engine_config()
    except (ValueError, ModelSourceError) as e:
        print(f"kvpilot serve: error: {_as_flag(str(e))}", file=sys.stderr)
        return 2

    from kvpilot.runtime.server.async_engine import AsyncEngine

    # the core first: it imports torch and builds its engine while this process imports the
    # server (FastAPI: seconds) and loads the tokenizer
    engine = AsyncEngine(engine_config, max_queue_len=args.max_queue_len)
    engine.spawn()
    try:
        with startup.phase("server_imports"):
            from kvpilot.runtime.server.app import ServerConfig, make_server
            from kvpilot.runtime.server.tenants import APIKeys
        try:
            server_config = ServerConfig(
                host=args.host, port=args.port,
                api_key=args.api_key or os.environ.get("KVPILOT_API_KEY") or None,
                api_keys=APIKeys.load(args.api_key_file) if args.api_key_file else None,
                admin_token=args.admin_token or os.environ.get("KVPILOT_ADMIN_TOKEN") or None,
                max_queue_len=args.max_queue_len, disable_log_stats=args.disable_log_stats,
                metric_interval=args.metric_interval, drain_timeout=args.drain_timeout,
                allowed_model_root=args.allowed_model_root, max_request_body_bytes=args.max_request_body_bytes,
                header_read_timeout=args.header_read_timeout,
                trust_request_chat_template=args.trust_request_chat_template, enable_docs=args.enable_docs,
            )
        except ValueError as e:
            engine.abandon()
            print(f"kvpilot serve: error: {_as_flag(str(e))}", file=sys.stderr)
            return 2
        server = make_server(engine_config, server_config, log_level=args.log_level, engine_args=engine_args,
                             startup=startup, engine=engine)
    except BaseException:
        engine.abandon()
        raise
    server.run()
    return 0


def _as_flag(message: str) -> str:
    """'max_model_len: ...' -> '--max-model-len: ...', so the line names the flag a user typed."""
    head, sep, rest = message.partition(":")
    if sep and head.isidentifier():
        return f"--{head.replace('_', '-')}:{rest}"
    return message
