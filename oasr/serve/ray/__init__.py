"""Scale-out on Ray Serve: one recognizer engine per GPU behind a router that keeps streams where they live.

::

                      client (RayStreams, or an HTTP front end holding the router's handle)
                                          |
                                          v
                 +-------------------------------------------------+
                 | StreamRouter (ingress deployment, one replica)  |
                 |   stream id -> engine   (sticky)                |
                 |   new stream -> least loaded open engine        |
                 |   migrate / drain / rebalance: suspend, resume  |
                 +-------------------------------------------------+
                   | handle            | handle              | handle
                   v                   v                     v
            +-------------+     +-------------+       +-------------+
            | engine0     |     | engine1     |  ...  | engineN-1   |   one deployment each, num_replicas=1
            | Recognizer  |     | Recognizer  |       | Recognizer  |   num_gpus=1 on a GPU cluster,
            | tick task   |     | tick task   |       | tick task   |   a CPU share otherwise
            +-------------+     +-------------+       +-------------+
                GPU 0               GPU 1                 GPU N-1

Each engine is its own single-replica deployment (``engine0`` ... ``engineN-1``), so a handle reaches exactly
that engine: a stream's caches live on one engine, and Serve's own replica choice (power of two choices, or
model multiplexing, which prefers but does not promise the replica holding a model) could send a request to an
engine that has never seen the stream. Ray places the engines (one per GPU with ``num_gpus=1``), restarts one
that fails its health check, and carries every call; the router only decides which engine a stream lives on.

The parts: ``replica`` (``EngineReplica``), ``router`` (``StreamRouter``), ``app`` (``build_app``, ``deploy``,
``start_local``, the ``RayStreams`` client); ``python -m oasr.serve.ray`` checks a cluster end to end.

``EngineReplica`` owns one ``Recognizer``. One task owns it and runs its ticks: calls from the router are
commands on a queue, applied by that task between ticks; the tick itself runs on a worker thread so the replica
keeps taking calls while it computes. After a tick that moved nothing the task sleeps until the next command.

Migration (``StreamRouter.migrate``, and ``drain`` / ``rebalance``, which use it) moves a stream through its
session bytes: ``Recognizer.suspend`` on the source (the stream leaves it, its blocks and slot are freed), the
bytes through Ray, ``Recognizer.resume`` on the target under the same id. The router holds the stream's lock
for the whole move, so the stream's calls wait and then go to the new engine; the client sees one stream. A
stream that has already finished moves as its transcript; one whose second pass (rescoring) is running moves
with its rescoring job. What a session restores is the stream exactly (K/V
window, conv and CTC state, unconsumed audio features, partial text); the resumed stream then computes in
the target engine's cohorts, so its transcript equals one that never moved (the tests check it against
``Recognizer.transcribe`` on shipped clips) and is bit-identical only where the cohort widths also match.

Bad input is refused where it is found and leaves the stream as it was: audio by the engine (``AudioError``, a
``ValueError``), unknown ids (``KeyError``) and unknown engines or an impossible drain (``ValueError``) by the
router. ``RayStreams`` raises them as those types, not wrapped in Ray's task errors.
"""

try:
    import ray  # noqa: F401
    from ray import serve  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("oasr.serve.ray needs Ray Serve: pip install 'oasr[ray]' (ray[serve])") from exc

from oasr.serve.ray.app import RayStreams, build_app, deploy, start_local
from oasr.serve.ray.replica import EngineReplica
from oasr.serve.ray.router import PLACEMENTS, StreamRouter

__all__ = ["PLACEMENTS", "EngineReplica", "RayStreams", "StreamRouter", "build_app", "deploy", "start_local"]
