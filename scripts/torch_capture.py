"""Run a trtgraph command with the runtime's graphs recorded by torch.cuda.CUDAGraph, as before the
thirteenth session (scripts/replay_drift.py `_torch_capture`), for before / after figures of the
driver-recorded graphs (runtime/step/cuda_graph.py) in one call:

    python3 scripts/torch_capture.py bench --config examples/llama-3.2-1b-synthetic.yaml --out /tmp/b0 ...
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from replay_drift import _torch_capture  # noqa: E402

from trtgraph.cli import entry  # noqa: E402
from trtgraph.runtime.step.graph_runner import GraphRunner  # noqa: E402

GraphRunner._capture_cuda = _torch_capture
sys.argv[0] = "trtgraph"
entry()
