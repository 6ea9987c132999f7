"""Where a decode step's GPU time goes: kernel count and per-kernel time of one step, from
the eager run of the same kernels a graph replays. Usage: python scripts/profile_step.py ARTIFACTS"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from trtgraph.bench import decode_rows
from trtgraph.buckets import GraphKey
from trtgraph.artifacts import load_manifest
from trtgraph.runtime.step.executor import Executor

manifest = load_manifest(sys.argv[1])  # eager only: the executor the manifest describes, no re-recording
ex = Executor.build(manifest.app_config(), manifest.plan())
for key in (k for k in (GraphKey(1, 0, 0, "greedy"), GraphKey(64, 0, 0, "greedy"), GraphKey(64, 0, 0, "sampled"))
            if k in ex.plan.keys):
    ex.prepare(key, decode_rows(ex, key.batch_size, 128))
    with torch.inference_mode():
        for _ in range(3):
            ex.execute(key, eager=True)
        torch.cuda.synchronize()
        steps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                ex.execute(key, eager=True)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events) / steps
    count = sum(e.count for e in events) / steps
    print(f"\n{key}: {count:.0f} kernels per step, {total / 1e3:.3f} ms of kernel time per step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:12]:
        print(f"  {e.device_time_total / steps / 1e3:7.3f} ms  x{e.count // steps:<4} {e.key[:90]}")
