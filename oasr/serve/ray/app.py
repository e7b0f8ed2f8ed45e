"""Building and running the Serve application: ``build_app``, ``start_local``, ``deploy``, and ``RayStreams``."""

from __future__ import annotations

import ray
from ray import serve

from oasr.serve.ray.replica import EngineReplica
from oasr.serve.ray.router import PLACEMENTS, StreamRouter


def build_app(num_engines: int | None = None, *, gpus: bool = False, engine_cpus: float = 1.0,
              recognizer_options: dict | None = None, torch_threads: int | None = 1,
              placement: str = "least_loaded", max_ongoing_requests: int = 1024):
    """The Serve application: ``num_engines`` engine deployments and the router, unbound from any cluster.

    ``gpus=True``: each engine asks Ray for one GPU (``num_gpus=1``, so Ray puts one engine on each GPU) and
    runs its recognizer on ``cuda`` unless ``recognizer_options`` names a device; ``num_engines`` defaults to
    the cluster's GPU count (Ray must be running). On the CPU each engine asks for ``engine_cpus`` CPUs
    (fractions are fine) and ``num_engines`` defaults to 2.
    """
    options = dict(recognizer_options or {})
    if gpus:
        options.setdefault("device", "cuda")
        if num_engines is None:
            num_engines = int(ray.cluster_resources().get("GPU", 0))
        actor = {"num_gpus": 1, "num_cpus": engine_cpus}
    else:
        num_engines = 2 if num_engines is None else num_engines
        actor = {"num_cpus": engine_cpus}
    if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"build_app: need at least one engine, got num_engines={num_engines!r}"
                         + (" (no GPU in the Ray cluster)" if gpus else ""))
    if placement not in PLACEMENTS:
        raise ValueError(f"build_app: placement must be one of {PLACEMENTS}, got {placement!r}")
    names = [f"engine{i}" for i in range(num_engines)]
    engine = serve.deployment(EngineReplica)
    engines = [engine.options(name=name, num_replicas=1, ray_actor_options=actor,
                              max_ongoing_requests=max_ongoing_requests).bind(name, options, torch_threads)
               for name in names]
    router = serve.deployment(StreamRouter).options(name="router", num_replicas=1,
                                                     ray_actor_options={"num_cpus": 0},
                                                     max_ongoing_requests=max_ongoing_requests)
    return router.bind(engines, names, placement)


def start_local(num_cpus: int | None = None, **init_options) -> None:
    """Start a local Ray instance for Serve without the dashboard or HTTP proxy (the router is reached by handle).

    A no-op for Ray when it is already running. ``init_options`` go to ``ray.init``.
    """
    if not ray.is_initialized():
        init_options.setdefault("include_dashboard", False)
        init_options.setdefault("log_to_driver", False)
        ray.init(num_cpus=num_cpus, **init_options)
    serve.start(proxy_location="Disabled")


def deploy(num_engines: int | None = None, *, name: str = "oasr", timeout_s: float = 120.0, **app_options):
    """Run ``build_app(num_engines, **app_options)`` on the running Ray cluster as application ``name``.

    Returns a ``RayStreams`` client on the router. Needs ``start_local`` (or a cluster) first.
    """
    handle = serve.run(build_app(num_engines, **app_options), name=name, route_prefix=None)
    return RayStreams(handle, timeout_s=timeout_s)


def _unwrap(exc: BaseException) -> BaseException:
    """The user's exception inside Ray's task error wrappers (router -> engine adds one per hop)."""
    while isinstance(exc, ray.exceptions.RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


class RayStreams:
    """A synchronous client on the router's handle: each method is the router's, waited for ``timeout_s``.

    Errors come out as the router or engine raised them (``KeyError``, ``ValueError``, ``AudioError``,
    ``TimeoutError``), not wrapped in Ray's task errors.
    """

    def __init__(self, handle, timeout_s: float = 120.0):
        self.handle = handle
        self.timeout_s = timeout_s

    def _call(self, method: str, *args, **kwargs):
        try:
            return getattr(self.handle, method).remote(*args, **kwargs).result(timeout_s=self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise _unwrap(exc) from None

    def open_stream(self, stream_id=None, engine: str | None = None):
        """Start a stream; returns its id (see ``StreamRouter.open_stream``)."""
        return self._call("open_stream", stream_id, engine)

    def accept(self, stream_id, pcm, sample_rate: int = 16000) -> None:
        """Feed mono PCM to a stream."""
        return self._call("accept", stream_id, pcm, sample_rate)

    def end(self, stream_id) -> None:
        """End a stream's audio."""
        return self._call("end", stream_id)

    def poll(self, stream_id) -> dict:
        """Partial or final text and the engine holding the stream."""
        return self._call("poll", stream_id)

    def result(self, stream_id, timeout_s: float = 60.0) -> dict:
        """Wait for and collect the final transcript."""
        return self._call("result", stream_id, timeout_s)

    def cancel(self, stream_id) -> None:
        """Drop a stream."""
        return self._call("cancel", stream_id)

    def migrate(self, stream_id, to: str | None = None) -> dict:
        """Move a stream to another engine through its session bytes."""
        return self._call("migrate", stream_id, to)

    def drain(self, engine: str) -> list:
        """Close an engine and move all its streams away; the moves."""
        return self._call("drain", engine)

    def restore(self, engine: str) -> None:
        """Reopen a drained engine."""
        return self._call("restore", engine)

    def rebalance(self) -> list:
        """Even out the stream counts of the open engines; the moves."""
        return self._call("rebalance")

    def placement(self) -> dict:
        """``{stream id: engine name}``."""
        return self._call("placement_of")

    def engines(self) -> list:
        """``[(engine name, closed), ...]``."""
        return self._call("engine_names")

    def loads(self) -> list:
        """Every engine's load (live and finished streams, pool usage, ticks)."""
        return self._call("loads")
