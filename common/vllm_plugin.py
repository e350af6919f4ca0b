"""vLLM general plugin: makes ``"kv_connector": "KVPushConnector"`` work without a module path.

Registered as the ``kv_push`` entry point in the ``vllm.general_plugins`` group; vLLM calls
``register()`` in every process it starts (possibly several times).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KVPushConnector"


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM without the v1 connector factory: nothing to register into
        logger.warning("kv_push: this vLLM has no KV connector factory; use "
                       "kv_connector_module_path=kv_push.common.connector")
        return
    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "kv_push.common.connector",
                                          CONNECTOR_NAME)
