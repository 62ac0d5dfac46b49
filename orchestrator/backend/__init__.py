"""llama.cpp backends: find a llama-server, build one from a pinned source, detect its flavor and features.

- :mod:`.info` — :class:`BackendInfo` and :class:`Flavor`: what a binary is and can do, a pure value.
- :mod:`.sources` — the pinned llama.cpp sources we know how to build (obtained through PyPI sdists).
- :mod:`.build` — reproducible, cached CMake builds (CPU by default, CUDA when ``nvcc`` is present).
- :mod:`.detect` — locate the binary and probe its flavor (mainline / ik_llama.cpp) and features from ``--help``.
  (Import it explicitly; it runs the binary, so it is not re-exported here and pure users stay free of
  subprocess.)
"""

from orchestrator.backend.info import BackendInfo, Flavor

__all__ = ["BackendInfo", "Flavor"]
