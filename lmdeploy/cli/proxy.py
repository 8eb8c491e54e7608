"""``lmdeploy serve proxy``: one address in front of several api_servers (:mod:`lmdeploy.serve.proxy`)."""
from __future__ import annotations

import argparse

from lmdeploy.serve.proxy.strategies import STRATEGIES  # pure Python: no server import

from .common import add_log_args


def add_proxy_parser(serve_sub) -> argparse.ArgumentParser:
    p = serve_sub.add_parser(
        'proxy', help='request distributor in front of several api_servers',
        description='Spread OpenAI-compatible requests over api_servers that register with it '
        '(lmdeploy serve api_server ... --proxy-url http://HOST:PORT) or are added with POST /nodes/add.')
    p.add_argument('--server-name', default='0.0.0.0', help='host to bind (default: %(default)s)')
    p.add_argument('--server-port', type=int, default=8000, help='port to bind (default: %(default)s)')
    p.add_argument('--strategy', default='min_expected_latency', choices=STRATEGIES,
                   help='how a node is chosen: random (weighted by measured speed), min_expected_latency '
                   '(shortest queue for its speed), min_observed_latency (fastest recent answers) '
                   '(default: %(default)s)')
    p.add_argument('--api-keys', nargs='+', default=None,
                   help='accepted API keys (Authorization: Bearer KEY) for requests and node registration; '
                   'default: no authentication')
    p.add_argument('--node', dest='nodes', action='append', default=[], metavar='URL',
                   help='a node to add at start-up (repeatable)')
    p.add_argument('--health-interval', type=float, default=10.0,
                   help='seconds between health checks of every node (default: %(default)s)')
    p.add_argument('--drop-after', type=int, default=3,
                   help='failed health checks in a row that drop a node (default: %(default)s)')
    p.add_argument('--request-timeout', type=float, default=600.0,
                   help='seconds a node may take to answer (or between stream chunks) (default: %(default)s)')
    p.add_argument('--state-file', default=None,
                   help='keep the node table in this JSON file, so a restarted proxy keeps its nodes')
    add_log_args(p, default='INFO')
    p.set_defaults(func=run_proxy)
    return p


def run_proxy(args) -> int:
    if not 0 <= args.server_port <= 65535:
        raise ValueError(f'--server-port must be in [0, 65535], got {args.server_port}')
    if args.health_interval <= 0:
        raise ValueError(f'--health-interval must be > 0, got {args.health_interval}')
    if args.drop_after < 1:
        raise ValueError(f'--drop-after must be >= 1, got {args.drop_after}')
    try:
        from lmdeploy.serve.proxy.app import serve
    except ImportError as e:
        raise RuntimeError(f"cannot start the proxy: {e}; install the server's dependencies: "
                           "pip install 'lmdeploy[serve]'") from e
    return serve(args.server_name, args.server_port, strategy=args.strategy, api_keys=args.api_keys,
                 health_interval=args.health_interval, drop_after=args.drop_after,
                 request_timeout=args.request_timeout if args.request_timeout > 0 else None,
                 state_file=args.state_file, nodes=args.nodes, log_level=args.log_level)
