"""Serving the recognizer: front ends that put ``oasr.asr.Recognizer`` behind a network API.

``oasr.serve.ray`` (the ``ray`` extra) runs one recognizer engine per GPU as Ray Serve deployments behind a
router that keeps every stream on its engine and moves live streams between engines through their session bytes.
"""
