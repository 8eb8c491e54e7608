"""The request distributor: ``lmdeploy serve proxy`` puts several api_servers behind one address.

* :mod:`.nodes` - the node table (what the proxy knows of each api_server) and its optional file;
* :mod:`.strategies` - which node gets the next request (pure Python);
* :mod:`.forward` - waiting for a node with room (or 429 / 503 beyond the bounds), passing a request
  to a node, retrying ones that never started, streaming through;
* :mod:`.health` - the periodic ``/health`` check that drops dead nodes and takes back the ones that
  answer again;
* :mod:`.app` - the FastAPI app and :func:`~lmdeploy.serve.proxy.app.serve`;
* :mod:`.register` - what an api_server started with ``--proxy-url`` uses to join, stay and leave.

Nothing is imported here: the api_server imports :mod:`.register` without pulling in the proxy's app.
"""
