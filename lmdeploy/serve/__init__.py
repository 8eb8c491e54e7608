"""Serving over HTTP.

* :mod:`lmdeploy.serve.openai.api_server` - the OpenAI-compatible REST server
  (``lmdeploy serve api_server MODEL``); needs ``pip install 'lmdeploy[serve]'``.
* :mod:`lmdeploy.serve.client` - :class:`~lmdeploy.serve.client.APIClient`, a
  small synchronous client for that server (needs only ``httpx``).

Nothing is imported here, so ``import lmdeploy.serve.client`` does not pull in
fastapi, pydantic or the engine.
"""
