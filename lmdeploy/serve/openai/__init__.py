"""The OpenAI-compatible API server: ``protocol`` (request / response models),
``api_server`` (the FastAPI app and :func:`~lmdeploy.serve.openai.api_server.serve`),
``metrics`` (Prometheus)."""
