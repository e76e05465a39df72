"""One third-party plugin that fails to import leaves the other backends working, and is
reported (name, error) by ``shim backends`` and when it is asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _install_broken_plugin(root) -> dict:
    """A distribution on PYTHONPATH whose ``shim_adapters`` entry point raises on import."""
    info = root / "shim_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shim-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[shim_adapters]\nbroken = shim_broken_mod\n")
    (root / "shim_broken_mod.py").write_text("raise ImportError('needs libfoo 9')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    return env


def test_a_broken_plugin_is_reported_and_the_others_keep_working(tmp_path):
    env = _install_broken_plugin(tmp_path)
    code = ("from shim_adapters.backends.registry import get_backend, broken_plugins\n"
            "print(get_backend('xgrammar').name)\n"
            "print(broken_plugins())\n"
            "try:\n    get_backend('broken')\nexcept Exception as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "xgrammar"
    assert "'broken': 'shim-broken: ImportError: needs libfoo 9'" in lines[1]
    assert "failed to import" in lines[2] and "needs libfoo 9" in lines[2]
    cli = subprocess.run([sys.executable, "-m", "shim_adapters.cli", "backends", "--json"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    rows = json.loads(cli.stdout)
    assert {"backend": "broken", "broken": "shim-broken: ImportError: needs libfoo 9"} in rows
    assert any(r.get("backend") == "xgrammar" and "version" in r for r in rows)
