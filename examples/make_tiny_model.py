#!/usr/bin/env python3
"""Build a tiny random Llama model and a locally trained tokenizer (no hub downloads).

Usage: make_tiny_model.py OUT_DIR [--seed N]

The builder is ``kv_push.common.testing.tiny_model`` (shared with the end-to-end tests and the
serving benchmark); this script needs kv_push installed in the Python that runs it.
"""

from kv_push.common.testing.tiny_model import main

if __name__ == "__main__":
    main()
