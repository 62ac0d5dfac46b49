"""The dashboard's token hint names a ``ray`` that runs where orchestrator runs (the quick start puts nothing on
PATH: ``.venv/bin/ray``)."""

from __future__ import annotations

import os
import subprocess

from orchestrator.cluster.startup import ray_cli


def test_the_token_hint_names_a_ray_command_that_runs():
    cmd = ray_cli()
    assert os.path.isabs(cmd) and os.access(cmd, os.X_OK), cmd
    r = subprocess.run([cmd, "get-auth-token", "--help"], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "authentication token" in r.stdout, r.stderr
