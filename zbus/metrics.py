"""Counters and histograms of a leader: RPCs, their latency and bytes, errors by
kind, heartbeats, dropped hostile frames. Read by ``zbus status`` and, when asked
for, served to Prometheus (``prometheus-client``, an optional dependency)."""

from __future__ import annotations

import bisect
import io
import socket
import sys
import threading
import time
from typing import Any

from .errors import SettingError

# Latency buckets (seconds): 10 us .. ~80 s, x2 apart.
BUCKETS = tuple(10e-6 * 2**i for i in range(24))
# The metrics port takes no key: a client has this long to send its request's head
# (of at most METRICS_HEAD_MAX bytes), trickled or not, and at most METRICS_CLIENTS
# are served at once (each holds a thread); the others are closed at once.
METRICS_IDLE_S = 10.0
METRICS_HEAD_MAX = 16 * 1024
METRICS_CLIENTS = 8


class Histogram:
    """Fixed buckets; percentiles interpolate within a bucket's bounds."""

    def __init__(self, bounds: tuple[float, ...] = BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def percentile(self, q: float) -> float | None:
        if not self.n:
            return None
        rank, seen = q * self.n, 0
        for i, c in enumerate(self.counts):
            if seen + c >= rank and c:
                lo = self.bounds[i - 1] if i else 0.0
                hi = self.bounds[i] if i < len(self.bounds) else self.bounds[-1] * 2
                return lo + (hi - lo) * (rank - seen) / c
            seen += c
        return self.bounds[-1]


class Metrics:
    """Thread-safe; one per leader."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.rpcs = 0
        self.errors: dict[str, int] = {}
        self.bytes_sent = 0
        self.latency = Histogram()
        self.heartbeats: dict[int, int] = {}
        self.dropped_frames = 0
        self.dropped_by: dict[str, int] = {}  # the same messages, by why they were dropped

    def rpc_done(self, seconds: float, error: BaseException | None) -> None:
        with self._lock:
            self.rpcs += 1
            self.latency.observe(seconds)
            if error is not None:
                kind = type(error).__name__
                self.errors[kind] = self.errors.get(kind, 0) + 1

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes

    def heartbeat(self, node_rank: int) -> None:
        with self._lock:
            self.heartbeats[node_rank] = self.heartbeats.get(node_rank, 0) + 1

    def dropped(self, n: int = 1, reason: str = "other") -> None:
        with self._lock:
            self.dropped_frames += n
            self.dropped_by[reason] = self.dropped_by.get(reason, 0) + n

    def drops(self) -> dict[str, int]:
        """Dropped messages by reason."""
        with self._lock:
            return dict(self.dropped_by)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            pct = {f"p{int(q * 100)}": self.latency.percentile(q) for q in (0.5, 0.9, 0.99)}
            return {"uptime_s": time.time() - self.started, "rpcs": self.rpcs,
                    "errors": dict(self.errors), "bytes_sent": self.bytes_sent,
                    "latency_s": pct, "latency_buckets": list(zip(BUCKETS, self.latency.counts)),
                    "latency_count": self.latency.n, "latency_sum_s": self.latency.total,
                    "heartbeats": dict(self.heartbeats), "dropped_frames": self.dropped_frames,
                    "dropped_by": dict(self.dropped_by)}


class MissingDependency(SettingError, ImportError):
    """A setting that needs a package this environment lacks."""


def serve_prometheus(metrics: Metrics, port: int, addr: str, describe: Any = None) -> Any:
    """Expose ``metrics`` on http://addr:port/metrics (needs ``prometheus-client``):
    the server and its thread."""
    try:
        from prometheus_client import make_wsgi_app
        from prometheus_client.core import (
            CollectorRegistry,
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
    except ImportError:
        raise MissingDependency("metrics_port needs prometheus-client: pip install prometheus-client"
                                ) from None

    class Collector:
        def collect(self):  # noqa: ANN202 - prometheus-client's protocol
            snap = metrics.snapshot()
            yield CounterMetricFamily("zbus_rpcs", "collective_rpc calls completed", value=snap["rpcs"])
            errors = CounterMetricFamily("zbus_rpc_errors", "failed calls by error type", labels=["kind"])
            for kind, n in snap["errors"].items():
                errors.add_metric([kind], n)
            yield errors
            yield CounterMetricFamily("zbus_bytes_sent", "RPC bytes published", value=snap["bytes_sent"])
            cum, buckets = 0, []
            for bound, count in snap["latency_buckets"]:
                cum += count
                buckets.append((repr(bound), cum))
            buckets.append(("+Inf", snap["latency_count"]))  # (of the same snapshot as the rest)
            yield HistogramMetricFamily("zbus_rpc_latency_seconds", "collective_rpc round trip",
                                        buckets=buckets, sum_value=snap["latency_sum_s"])
            hb = CounterMetricFamily("zbus_heartbeats", "heartbeats received", labels=["node"])
            for node, n in snap["heartbeats"].items():
                hb.add_metric([str(node)], n)
            yield hb
            yield CounterMetricFamily("zbus_dropped_frames", "hostile or malformed messages dropped",
                                      value=snap["dropped_frames"])
            yield GaugeMetricFamily("zbus_uptime_seconds", "leader uptime", value=snap["uptime_s"])

    registry = CollectorRegistry()
    registry.register(Collector())
    return _serve(make_wsgi_app(registry), port, addr)


def _serve(scrape: Any, port: int, addr: str) -> tuple[Any, threading.Thread]:
    """prometheus-client's server, less what an unauthenticated client could do
    with it: hold a thread for good by sending nothing or trickling its request,
    start threads without end, or print a traceback on the driver's stderr by a
    request it cannot parse."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    clients = threading.BoundedSemaphore(METRICS_CLIENTS)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

        def process_request(self, request: Any, client_address: Any) -> None:
            if not clients.acquire(blocking=False):
                self.shutdown_request(request)  # (as many as it serves already)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:  # no thread to be had: served by none
                clients.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                clients.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # (a client that timed out or went away: the next one is served)

    class Handler(WSGIRequestHandler):
        timeout = METRICS_IDLE_S

        def setup(self) -> None:
            super().setup()
            # the head read here, whole, by its deadline (the handler's own reads time
            # out per byte received); nothing of it: no request, closed
            self.rfile = io.BytesIO(_request_head(self.connection, time.monotonic() + METRICS_IDLE_S))
            self.connection.settimeout(METRICS_IDLE_S)

        def log_message(self, *args: Any) -> None:
            pass  # (a scrape is no news)

    def app(environ: dict, start_response: Any) -> Any:
        try:
            return scrape(environ, start_response)
        except Exception:  # noqa: BLE001 - an Accept header prometheus-client cannot parse, say
            start_response("400 Bad Request", [("Content-Type", "text/plain")], sys.exc_info())
            return [b"bad request\n"]

    server = make_server(addr, port, app, Server, handler_class=Handler)
    thread = threading.Thread(target=server.serve_forever, name="zbus-metrics", daemon=True)
    thread.start()
    return server, thread


def _request_head(sock: socket.socket, deadline: float) -> bytes:
    """An HTTP request's head (up to its blank line) read by ``deadline`` within
    ``METRICS_HEAD_MAX`` bytes; b"" if it did not come whole. A scrape is a GET:
    no body follows."""
    head = b""
    while b"\r\n\r\n" not in head:
        left = deadline - time.monotonic()
        if left <= 0 or len(head) > METRICS_HEAD_MAX:
            return b""
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:  # (its deadline, a reset)
            return b""
        if not chunk:
            return b""
        head += chunk
    return head
