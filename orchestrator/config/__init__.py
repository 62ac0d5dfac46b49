"""topology.yaml → a typed, frozen :class:`Topology`; every error names the file, the line and the key.

    from orchestrator.config import load_topology, is_auto
    topo = load_topology("topologies/demo.yaml")
    topo.workers.threads          # "auto" (the plan decides) or an int
    topo.nodes[0].vram_limit      # "auto", bytes, or a tuple of bytes per GPU
    raise topo.error("nodes.0.gpus", "GPU 3 does not exist")   # ConfigError "FILE:LINE: nodes[0].gpus: ..."

``python -m orchestrator.config FILE…`` validates files; ``--reference`` prints docs/topology.md.
"""

from orchestrator.config.loader import load_topology, parse_overrides, parse_topology
from orchestrator.config.schema import (
    KV_TYPES_IK_ONLY, KV_TYPES_MAINLINE, KV_TYPES_UNQUANTIZED, BackendConfig, GatewayConfig, ModelConfig,
    NodeConfig, RayConfig, RestartConfig, Topology, WorkersConfig, display_key,
)
from orchestrator.config.types import AUTO, is_auto, parse_duration

__all__ = [
    "AUTO", "BackendConfig", "GatewayConfig", "KV_TYPES_IK_ONLY", "KV_TYPES_MAINLINE", "KV_TYPES_UNQUANTIZED",
    "ModelConfig", "NodeConfig", "RayConfig", "RestartConfig", "Topology", "WorkersConfig", "display_key",
    "is_auto", "load_topology", "parse_duration", "parse_overrides", "parse_topology",
]
