#!/usr/bin/env bash
# The twentieth session's device calls: the nineteenth's (scripts/s19_gpu.sh), run on this session's tree.
#  1: `pytest -m gpu tests/`;  2: the bench (decode bs 1-64 against the floor, prefill, run, mixed), the step
#     profile, 256 greedy prompts captured, replayed and --eager.
# Usage: OUT=... CALL=N bash scripts/s20_gpu.sh
exec bash "$(dirname "$0")/s19_gpu.sh"
