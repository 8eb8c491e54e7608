"""``lmdeploy serve proxy``: one address in front of several api_servers (:mod:`lmdeploy.serve.proxy`)."""
from __future__ import annotations

import argparse

from lmdeploy.serve.proxy.strategies import STRATEGIES  # pure Python: no server import

from .common import add_log_args


def add_proxy_parser(serve_sub) -> argparse.ArgumentParser:
    p = serve_sub.add_parser(
        'proxy', help='request distributor in front of several api_servers',
        description='Spread OpenAI-compatible requests over api_servers that register with it '
        '(lmdeploy serve api_server ... --proxy-url http://HOST:PORT) or are added with POST /nodes/add. '
        'Each node gets a bounded number of requests at once; the rest wait in the proxy for the first node '
        'with room, and beyond a bounded queue are answered 429 (or 503 after --queue-timeout) with Retry-After.')
    p.add_argument('--server-name', default='0.0.0.0',
                   help='host to bind (default: %(default)s, every interface). Without --api-keys anyone who '
                   'reaches it may send requests, but nodes may only be added or removed from this machine '
                   '(127.0.0.1 / ::1): set --api-keys to register api_servers of other hosts, or bind 127.0.0.1 '
                   'to keep the proxy local')
    p.add_argument('--server-port', type=int, default=8000, help='port to bind (default: %(default)s)')
    p.add_argument('--strategy', default='min_expected_latency', choices=STRATEGIES,
                   help='how a node is chosen: random (weighted by measured speed), min_expected_latency '
                   '(shortest queue for its speed), min_observed_latency (fastest recent answers) '
                   '(default: %(default)s)')
    p.add_argument('--api-keys', nargs='+', default=None,
                   help='accepted API keys (Authorization: Bearer KEY) for requests and node registration; '
                   'default: none (no authentication; node management from this machine only)')
    p.add_argument('--node', dest='nodes', action='append', default=[], metavar='URL',
                   help='a node to add at start-up (repeatable)')
    p.add_argument('--health-interval', type=float, default=10.0,
                   help='seconds between health checks of every node (default: %(default)s)')
    p.add_argument('--drop-after', type=int, default=3,
                   help='health checks in a row without an answer that drop a node; failed requests do not count. '
                   'A dropped node is still probed and gets traffic again once it answers /health '
                   '(default: %(default)s)')
    p.add_argument('--forget-after', type=float, default=3600.0,
                   help='seconds a dropped node is probed before it is removed from the table; 0: never '
                   '(default: %(default)s)')
    p.add_argument('--node-slots', type=int, default=None,
                   help='requests the proxy keeps at one node at once (running there or queued in its engine); '
                   'more wait in the proxy for the first node with room. Default: the max batch size the node '
                   'registered with, plus an eighth (at least 2); 64 for a node that did not say')
    p.add_argument('--node-queue', type=int, default=None,
                   help='streamed requests at one node that it has not begun answering (queued in its engine); '
                   'default: a quarter of its slots, at least 4')
    p.add_argument('--max-queue', type=int, default=None,
                   help='requests that may wait in the proxy per healthy node that could take them; beyond it, '
                   'new requests get 429 with Retry-After. 0: none wait. Default: as many as the node\'s slots')
    p.add_argument('--queue-timeout', type=float, default=60.0,
                   help='seconds a request may wait in the proxy for a node with room before it gets 503 with '
                   'Retry-After; 0: no limit (default: %(default)s)')
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
    if args.forget_after < 0:
        raise ValueError(f'--forget-after must be >= 0 (0: never), got {args.forget_after}')
    for flag, value, low in (('--node-slots', args.node_slots, 1), ('--node-queue', args.node_queue, 1),
                             ('--max-queue', args.max_queue, 0)):
        if value is not None and value < low:
            raise ValueError(f'{flag} must be >= {low}, got {value}')
    if args.queue_timeout < 0:
        raise ValueError(f'--queue-timeout must be >= 0 (0: no limit), got {args.queue_timeout}')
    try:
        from lmdeploy.serve.proxy.app import serve
    except ImportError as e:
        raise RuntimeError(f"cannot start the proxy: {e}; install the server's dependencies: "
                           "pip install 'lmdeploy[serve]'") from e
    return serve(args.server_name, args.server_port, strategy=args.strategy, api_keys=args.api_keys,
                 health_interval=args.health_interval, drop_after=args.drop_after, forget_after=args.forget_after,
                 request_timeout=args.request_timeout if args.request_timeout > 0 else None,
                 state_file=args.state_file, nodes=args.nodes, node_slots=args.node_slots, node_queue=args.node_queue,
                 max_queue=args.max_queue, queue_timeout=args.queue_timeout if args.queue_timeout > 0 else None,
                 log_level=args.log_level)
