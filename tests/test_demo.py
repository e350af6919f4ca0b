"""The README's demo command runs and verifies its bytes (a small configuration)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl


def test_demo_moves_and_verifies_kv_between_two_processes():
    demo = Path(sys.executable).parent / "kv-push-demo"
    argv = [str(demo)] if demo.exists() else [sys.executable, "-m", "kv_push.common.demo"]
    out = subprocess.run(argv + ["--requests", "4", "--min-tokens", "300", "--max-tokens", "900"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ALL VERIFIED" in out.stdout
    assert "total: 4/4 received" in out.stdout
