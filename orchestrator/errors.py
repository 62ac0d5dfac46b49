"""Errors a user can cause. Each carries one clear line; the CLI prints it and exits 2 (no traceback).

Bugs are not OrchestratorErrors: they still raise with a traceback.
"""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base of every user-facing error: ``str(err)`` is the one line the user sees."""

    exit_code = 2


class ConfigError(OrchestratorError):
    """topology.yaml is wrong: the message names the file, line and dotted key."""


class HardwareError(OrchestratorError):
    """A machine description (live, sysfs root or dump) cannot be read."""


class ModelError(OrchestratorError):
    """A GGUF file is missing, malformed or unsupported: the message names the file."""


class PlanError(OrchestratorError):
    """No plan satisfies the request: the message gives the numbers and what to change."""


class BackendError(OrchestratorError):
    """llama-server is missing, cannot be built, or lacks a feature the plan needs."""


class LaunchError(OrchestratorError):
    """A worker could not be started or kept running."""


class ClusterError(OrchestratorError):
    """Ray cannot be reached or the running deployment is not in the expected state."""
