"""Prometheus metrics and health endpoints, one registry per service instance.

`Metrics` holds every series DroidMesh exports (a service only moves the ones it owns).
`HealthServer` serves, from its own thread (so a busy event loop cannot hide it):
  /metrics  Prometheus text format
  /livez    200 while the event loop has ticked within `stall_s` (a wedged loop fails it); it
            is up before the model loads, so a slow load is not mistaken for a dead process
  /readyz   200 while `ready()` says so (the service runtime: started, every supervised
            background loop running, not stopping)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from droidmesh.shared.alarms import alarms
from droidmesh.shared.transport import slots


class _AlarmCollector:
    def collect(self) -> Any:
        family = CounterMetricFamily("dm_control_rejected", "Control messages refused, by kind and reason",
                                     labels=["kind", "reason"])
        for (kind, reason), n in sorted(alarms().items()):
            family.add_metric([kind, reason], n)
        yield family
        dropped = CounterMetricFamily("dm_bulk_connections_dropped",
                                      "Bulk-channel connections let go or refused, by channel and reason",
                                      labels=["channel", "reason"])
        for (channel, reason), n in sorted(slots.dropped().items()):
            dropped.add_metric([channel, reason], n)
        yield dropped

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, service: str):
        r = self.registry = CollectorRegistry()
        self.service = service
        # registered in this order, which is the order /metrics lists them in
        self._receiver_series(r)
        self._sender_series(r)
        self._broker_series(r)
        r.register(_AlarmCollector())
        self._gateway_series(r)

    def _receiver_series(self, r: CollectorRegistry) -> None:
        self.requests = Counter("dm_requests", "Generate requests by path taken and fallback reason",
                                ["path", "reason"], registry=r)
        self.ttft = Histogram("dm_ttft_seconds", "Time to first token by path", ["path"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.stage = Histogram("dm_stage_seconds", "Seconds from request start to each stage", ["stage"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.decode_steps = Counter("dm_decode_steps", "Decode steps run (each one forward for every request in the "
                                    "batch)", registry=r)
        self.decode_rows = Counter("dm_decode_rows", "Request-steps decoded (rows / steps: the mean decode batch)",
                                   registry=r)
        self.bytes_pulled = Counter("dm_bytes_pulled", "Bytes pulled over UCX", registry=r)
        self.ucx_throughput = Histogram("dm_ucx_throughput_bytes_per_second", "Per-pull UCX throughput",
                                        buckets=(1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10), registry=r)
        self.lookups = Counter("dm_cache_lookups", "Cache lookups by result (hit / miss)", ["result"], registry=r)
        self.relay = Counter("dm_relay_requests", "Requests where relaying was weighed, by reusable-prefix bucket "
                             "and outcome (relayed, own_prefill: as the policy chose; control, blind: the audit's arms)",
                             ["bucket", "outcome"], registry=r)
        # The benefit of a relayed request (predicted own-prefill TTFT minus its actual TTFT) may be
        # negative; counters only grow, so gains and losses count apart (benefit = saved - lost).
        self.saved = Counter("dm_relay_saved_seconds", "TTFT seconds relayed requests saved against their predicted "
                             "own prefill", registry=r)
        self.lost = Counter("dm_relay_lost_seconds", "TTFT seconds relayed requests lost against their predicted "
                            "own prefill", registry=r)
        self.prediction_error = Histogram("dm_prediction_error_ratio", "|predicted - actual| / actual TTFT of the "
                                          "served option", buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0), registry=r)
        self.agreement = Gauge("dm_shadow_agreement", "Mean shadow token agreement over the quality watch's window, "
                               "per sender model", ["sender_model"], registry=r)
        self.drift = Counter("dm_quality_drift", "Quality drops the watch raised (each asks for a re-profile), "
                             "per sender model", ["sender_model"], registry=r)
        self.profile_version = Gauge("dm_profile_version", "Recompute profile version in use per sender model",
                                     ["sender_model"], registry=r)

    def _sender_series(self, r: CollectorRegistry) -> None:
        self.store_bytes = Gauge("dm_store_bytes", "Bytes held in the KV/E store", registry=r)
        self.store_contexts = Gauge("dm_store_contexts", "Contexts held in the store", registry=r)
        self.evictions = Counter("dm_store_evictions", "Contexts evicted from the store", registry=r)
        self.store_device_bytes = Gauge("dm_store_device_bytes", "Bytes of the store's contexts in device memory",
                                        registry=r)
        self.tier_moves = Counter("dm_store_tier_moves", "Contexts moved from device to host memory to stay within "
                                  "the device budget (served from there, not evicted)", registry=r)
        self.prefills = Counter("dm_prefills", "Contexts captured (prefilled) by the sender", registry=r)

    def _broker_series(self, r: CollectorRegistry) -> None:
        self.index_contexts = Gauge("dm_index_contexts", "(sender, context) holders in the broker index", registry=r)
        self.expired_senders = Counter("dm_expired_senders", "Senders dropped for missing heartbeats", registry=r)
        self.index_senders = Gauge("dm_index_senders", "Senders the broker tracks", registry=r)
        self.swept_holders = Counter("dm_swept_holders", "Holders dropped for a stale announcement", registry=r)
        self.index_bytes = Gauge("dm_index_bytes", "Bytes the broker index charges its holders (tokens, block keys, "
                                 "metadata)", registry=r)
        self.over_budget = Counter("dm_broker_over_budget", "Sender events over a broker budget, by what befell them "
                                   "(deferred, dropped, evicted holders, dropped heartbeats)", ["reason"], registry=r)
        self.queued_events = Gauge("dm_broker_queued_events", "Sender events deferred for their sender's budget",
                                   registry=r)

    def _gateway_series(self, r: CollectorRegistry) -> None:
        self.gateway_requests = Counter("dm_gateway_requests", "Gateway HTTP requests by route and status",
                                        ["route", "status"], registry=r)
        self.gateway_seconds = Histogram("dm_gateway_request_seconds", "Gateway request duration (streams: to the last event)",
                                         ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.gateway_inflight = Gauge("dm_gateway_inflight", "Gateway HTTP requests in flight", registry=r)
        self.gateway_tokens = Counter("dm_gateway_tokens", "Tokens through the gateway by kind (prompt, completion, reused)",
                                      ["kind"], registry=r)
        # per API key id (bounded by the key file); the key itself is never a label or a log field
        self.gateway_key_requests = Counter("dm_gateway_key_requests", "Gateway requests by API key id and status",
                                            ["key_id", "status"], registry=r)
        self.gateway_key_tokens = Counter("dm_gateway_key_tokens", "Tokens through the gateway by API key id and kind "
                                          "(prompt, completion, reused)", ["key_id", "kind"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    def __init__(self, metrics: Metrics, port: int, ready: Callable[[], bool], stall_s: float = 10.0, host: str = "127.0.0.1"):
        self.metrics = metrics
        self._ready = ready  # called from the health thread: reads flags only, never blocks
        self._stall_s = stall_s
        self._tick = time.monotonic()
        # the configured host only: metrics name models and pairs, so they are not for every interface
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="health", daemon=True)
        self._ticker: asyncio.Task | None = None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path == "/metrics":
                    self._send(200, server.metrics.render(), CONTENT_TYPE_LATEST)
                elif self.path == "/livez":
                    ok = time.monotonic() - server._tick < server._stall_s
                    self._send(200 if ok else 503, b"ok\n" if ok else b"event loop stalled\n")
                elif self.path == "/readyz":
                    ok = server._ready()
                    self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # probes every few seconds: keep logs quiet
                return

        return Handler

    async def _tick_loop(self) -> None:
        while True:
            self._tick = time.monotonic()
            await asyncio.sleep(1.0)

    def start(self) -> None:
        self._thread.start()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="health-tick")

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        self._httpd.shutdown()
        self._httpd.server_close()
