"""The OpenAI-compatible API server: ``protocol`` (request / response models),
``api_server`` (the FastAPI app and :func:`~lmdeploy.serve.openai.api_server.serve`),
``metrics`` (Prometheus); the app's parts: ``errors``, ``guard`` (API keys,
body size, readiness), ``state``, ``sessions``, ``params`` and ``jobs``."""
