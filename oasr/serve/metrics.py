"""``GET /metrics``: the server's state in the Prometheus text format (prometheus-client).

Each app has its own ``CollectorRegistry`` (two servers in one process do not mix their counts).
Gauges are read at scrape time from the worker's last published ``WorkerStats``; the tick
histogram and the request counter are updated as things happen.

=================================  =========  ==============================================
name                               type       meaning
=================================  =========  ==============================================
oasr_streams_active                gauge      streams holding a slot (uploads and live)
oasr_streams_waiting               gauge      requests waiting for a slot (admission queue)
oasr_engine_streams{state}         gauge      the engine's own view: ``active`` (encoding) or
                                              ``waiting`` (granted, less than a chunk buffered)
oasr_pool_blocks{kind}             gauge      K/V pool blocks ``used`` / ``total``
oasr_pool_slots{kind}              gauge      stream slots ``used`` / ``total``
oasr_real_time_factor              gauge      compute seconds per second of audio, since start
oasr_audio_seconds_total           counter    audio taken, seconds
oasr_sessions_suspended            gauge      suspended streams saved in the state directory
oasr_streams_ended_total{reason}   counter    streams ended: completed / cancelled (client gone)
                                              / suspended (shutdown) / failed (an internal
                                              error ended the stream; the others went on)
oasr_engine_up                     gauge      1 while the worker thread runs, 0 if it does not
oasr_checkpoints_total             counter    live-stream checkpoints written (--checkpoint-every)
oasr_checkpoint_bytes_total        counter    their bytes
oasr_checkpoint_seconds_total      counter    worker time spent on them (session + write + fsync)
oasr_tick_seconds                  histogram  wall time of the engine ticks that encoded audio
oasr_requests_total{endpoint,      counter    finished requests; ``status`` is the HTTP status,
status}                                       or for WebSockets completed / disconnected /
                                              suspended / failed / gone / an HTTP status for
                                              a refusal
=================================  =========  ==============================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _WorkerCollector:
    """Reads the worker's published snapshot at scrape time."""

    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        """The gauges of the current ``WorkerStats``."""
        s = self.worker.stats
        yield GaugeMetricFamily("oasr_streams_active", "streams holding a slot", value=s.streams_active)
        yield GaugeMetricFamily("oasr_streams_waiting", "requests waiting for a slot", value=s.streams_waiting)
        engine = GaugeMetricFamily("oasr_engine_streams", "streams in the engine by state", labels=["state"])
        engine.add_metric(["active"], s.engine_active)
        engine.add_metric(["waiting"], s.engine_waiting)
        yield engine
        for name, what in (("blocks", "K/V pool blocks"), ("slots", "stream slots")):
            family = GaugeMetricFamily(f"oasr_pool_{name}", what, labels=["kind"])
            family.add_metric(["used"], s.pool.get(f"{name}_used", 0))
            family.add_metric(["total"], s.pool.get(f"{name}_total", 0))
            yield family
        yield GaugeMetricFamily("oasr_real_time_factor", "compute seconds per second of audio",
                                value=s.real_time_factor)
        yield CounterMetricFamily("oasr_audio_seconds", "audio taken, seconds", value=s.audio_seconds)
        ended = CounterMetricFamily("oasr_streams_ended", "streams ended since start, by how", labels=["reason"])
        for reason, count in s.ended.items():
            ended.add_metric([reason], count)
        yield ended
        yield GaugeMetricFamily("oasr_sessions_suspended", "suspended streams saved in the state directory",
                                value=s.suspended_on_disk)
        yield GaugeMetricFamily("oasr_engine_up", "1 while the engine worker thread runs",
                                value=1 if self.worker.alive else 0)
        c = s.checkpoints
        yield CounterMetricFamily("oasr_checkpoints", "live-stream checkpoints written", value=c.get("written", 0))
        yield CounterMetricFamily("oasr_checkpoint_bytes", "bytes of live-stream checkpoints written",
                                  value=c.get("bytes", 0))
        yield CounterMetricFamily("oasr_checkpoint_seconds", "worker seconds spent writing checkpoints",
                                  value=c.get("seconds", 0.0))


class ServeMetrics:
    """The registry of one app: the worker's gauges, the tick histogram, requests by status."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.ticks = Histogram("oasr_tick_seconds", "wall time of engine ticks that encoded audio",
                               buckets=TICK_BUCKETS, registry=self.registry)
        self.requests = Counter("oasr_requests", "finished requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)

    def watch(self, worker) -> None:
        """Export ``worker``'s snapshot and time its ticks."""
        self.registry.register(_WorkerCollector(worker))
        worker.on_tick = self.ticks.observe

    def count(self, endpoint: str, status) -> None:
        """One finished request."""
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        """The text exposition of everything registered."""
        return generate_latest(self.registry)
