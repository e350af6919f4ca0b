"""``python -m kv_push.common.router``: the same as the ``kv-push-router`` command."""

from kv_push.common.router.app import main

main()
