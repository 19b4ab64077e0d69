"""`kvpilot operator`: run the InferenceService controller."""

from __future__ import annotations

import argparse
import logging
import os

from . import monitoring

DEFAULT_IMAGE = "ghcr.io/kvpilot/kvpilot-runtime:0.1.0"  # docker/runtime.Dockerfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", dest="namespaces", action="append", metavar="NS",
                       help="watch this namespace (repeatable; globs such as 'team-*' work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--image", default=os.environ.get("KVPILOT_IMAGE", DEFAULT_IMAGE),
                        help="runtime image for InferenceServices that name none (env KVPILOT_IMAGE; "
                             "default %(default)s)")
    parser.add_argument("--peering", metavar="NAME",
                        help="kopf peering object shared by the operator's replicas (required when "
                             "running more than one); without it, a peering named 'default' is used "
                             "if it exists")
    parser.add_argument("--standalone", action="store_true", help="ignore peering entirely")
    parser.add_argument("--priority", type=int, default=0,
                        help="peering priority: the highest-priority replica works, others wait")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="serve /metrics on this port (0: off; default %(default)s)")
    parser.add_argument("--health-port", type=int, default=8081,
                        help="serve /healthz (liveness) and /readyz (the API server is reachable) on this "
                             "port (0: off; default %(default)s)")
    parser.add_argument("--resync-interval", type=float, default=300.0, metavar="SECONDS",
                        help="re-check every InferenceService this often, a safety net for a missed event "
                             "(default %(default)s)")
    parser.add_argument("--workers", type=int, default=4,
                        help="InferenceServices reconciled at once (default %(default)s)")
    parser.add_argument("--prometheus-address", default=None, metavar="URL",
                        help="Prometheus that KEDA ScaledObjects query (spec.autoscaling.mode keda) when a spec "
                             "names none, e.g. http://prometheus.monitoring.svc:9090")
    parser.add_argument("--engine-cache-host-path", default=None, metavar="PATH",
                        help="a node folder mounted into every engine pod for its caches (Triton's compiled "
                             "kernels, the engine's), so a second pod on the node compiles nothing; it must be "
                             "writable by uid 1000 (default: each pod its own emptyDir)")
    monitoring.add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    parser.add_argument("--debug", action="store_true", help="log everything, including API traffic")


def run(args: argparse.Namespace) -> int:
    import kopf

    from . import handlers, metrics

    if not args.namespaces and not args.all_namespaces:
        print("kvpilot operator: choose the namespaces to watch: --namespace NS (repeatable) or --all-namespaces")
        return 2
    if args.peering and args.standalone:
        print("kvpilot operator: --peering and --standalone exclude each other")
        return 2
    try:
        engine_monitoring = monitoring.from_args(args)
    except ValueError as exc:  # already names the flag
        print(f"kvpilot operator: {exc}")
        return 2
    try:
        config = handlers.OperatorConfig(image=args.image, resync_interval=args.resync_interval,
                                         workers=args.workers, health_port=args.health_port,
                                         monitoring=engine_monitoring, prometheus_address=args.prometheus_address,
                                         engine_cache_host_path=args.engine_cache_host_path or None)
    except ValueError as exc:
        print(f"kvpilot operator: --{str(exc).split(':')[0].replace('_', '-')}:{str(exc).partition(':')[2]}")
        return 2
    kopf.configure(verbose=args.verbose, debug=args.debug)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if not (args.verbose or args.debug):  # a line per watch event says nothing our Events do not
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, config)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    kopf.run(
        registry=registry,
        clusterwide=args.all_namespaces,
        namespaces=args.namespaces or (),
        standalone=args.standalone or None,
        peering_name=args.peering,
        priority=args.priority,
    )
    return 0
