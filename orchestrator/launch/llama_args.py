"""llama-server's and numactl's vocabulary, for both flavors: the one place their flags and variables are spelled.

Pure: no processes, files or network (the planner imports it).
"""

from __future__ import annotations

OFFLOAD_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"
OFFLOAD_DEFAULT = 32          # llama.cpp's op-offload threshold when nothing sets it
OFFLOAD_NEVER = 1 << 30       # larger than any batch: host-resident weights are never copied to the GPU
