"""``lmdeploy serve gradio``: a chat page in the browser (Gradio, the optional extra ``lmdeploy[gradio]``).

backend.py: what the page needs from an engine (a chat session per browser tab, streamed turns, stop,
reset); local.py: the engine in this process, through :class:`~lmdeploy.frontend.pipeline.Pipeline`;
remote.py: a running ``api_server``, through its ``/generate`` endpoint; page.py: the page itself.
Gradio is imported only by page.py, so the backends work (and are tested) without it.
"""
