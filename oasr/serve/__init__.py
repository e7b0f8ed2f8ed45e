"""Serving the recognizer: an HTTP and WebSocket front end (``python -m oasr serve``).

``oasr.serve.protocol`` the wire formats, ``oasr.serve.worker`` the thread that owns the engine,
``oasr.serve.state`` the session files (atomic writes, the writer thread), ``oasr.serve.metrics`` the
Prometheus metrics, ``oasr.serve.app`` the FastAPI app and its server.
Needs the ``serve`` extra (FastAPI, uvicorn, python-multipart, prometheus-client).
``oasr.serve.ray`` (the ``ray`` extra) runs one engine per GPU on Ray Serve behind a router that keeps each
stream on its engine and moves live streams between engines through their session bytes.
"""
