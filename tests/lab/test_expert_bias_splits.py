"""lab/bench/expert_bias_splits.py on ggml's RPC device: where gpt-oss's expert biases lie decides how often a cached
decode step goes to the CPU; the other families' cached layers never do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

pytestmark = pytest.mark.integration


def test_the_biases_in_host_memory_add_three_cpu_splits_per_layer(llama_server_path, tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "lab" / "bench" / "expert_bias_splits.py"), "--tokens", "8",
                          "--dir", str(tmp_path), "--server", llama_server_path],
                         capture_output=True, text=True, env=ENV, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {}
    for line in res.stdout.splitlines():
        m = re.match(r"(\S+)\s+(plan's -ot|biases on the device)\s+(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s*(.*)$", line)
        if m:
            rows[(m.group(1), m.group(2))] = (int(m.group(3)), int(m.group(4)), m.group(5))
    host, device = rows[("gpt-oss-20b", "plan's -ot")], rows[("gpt-oss-20b", "biases on the device")]
    qwen = rows[("qwen3-30b-a3b", "plan's -ot")]
    # 2 layers x 3 ADD_IDs on the CPU, each a split of its own, and the GPU split after it
    assert "ADD_ID" in host[2] and "ADD_ID" not in device[2]
    assert host[1] - device[1] == 2 * 3
    assert host[0] - device[0] == 2 * 5
    assert device[0] == qwen[0] and device[1] == qwen[1] == 1        # the token's embedding row, on the CPU
    for family in ("deepseek-v3", "glm-4.5-air"):
        assert "ADD_ID" not in rows[(family, "plan's -ot")][2] and rows[(family, "plan's -ot")][1] == 1
    assert "gpt-oss-20b: the greedy tokens with the biases on the device are the same" in res.stdout
