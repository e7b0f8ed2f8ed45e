"""Serving the recognizer: an HTTP and WebSocket front end (``python -m oasr serve``).

``oasr.serve.protocol`` the wire formats, ``oasr.serve.worker`` the thread that owns the engine,
``oasr.serve.metrics`` the Prometheus metrics, ``oasr.serve.app`` the FastAPI app and its server.
Needs the ``serve`` extra (FastAPI, uvicorn, python-multipart, prometheus-client).
"""
