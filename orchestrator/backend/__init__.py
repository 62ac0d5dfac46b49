"""llama.cpp backends: find a llama-server, build one from a pinned source, detect its flavor and features.

- :mod:`.sources` — the pinned llama.cpp sources we know how to build (obtained through PyPI sdists).
- :mod:`.build` — reproducible, cached CMake builds (CPU by default, CUDA when ``nvcc`` is present).
- :mod:`.detect` — locate the binary and read its flavor (mainline / ik_llama.cpp) and features from ``--help``.
"""

from orchestrator.backend.detect import BackendInfo, detect_backend, find_llama_server

__all__ = ["BackendInfo", "detect_backend", "find_llama_server"]
