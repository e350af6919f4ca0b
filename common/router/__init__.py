"""The P/D router (``kv-push-router``): an OpenAI-compatible HTTP front for prefill and decode
vLLM servers. Independent of the connector core; needs the ``router`` extra.

Modules: :mod:`.app` (ASGI app, dispatch, streaming; ``build_app``, ``main``), :mod:`.config`
(command line -> frozen ``RouterConfig``), :mod:`.pool` (backends and least-outstanding
selection). Design notes: ``docs/router.md``.
"""
