"""Typed errors. Each one says what went wrong and what to do next.

The CLI turns any TrtgraphError into exit code 2 with its message and no traceback;
set TRTGRAPH_RAISE_ERRORS=1 to see the traceback.
"""


class TrtgraphError(Exception):
    """Base of every error trtgraph raises on purpose (bad input, mismatch, refusal)."""


class ConfigError(TrtgraphError):
    """model.yaml (or the embedded default) is malformed or asks for the impossible."""


class WeightLoadError(TrtgraphError):
    """A checkpoint is missing, corrupt, or does not match its config.json."""


class ManifestError(TrtgraphError):
    """A manifest is unreadable, from another version, or does not match this machine."""


class BucketMissError(TrtgraphError):
    """A batch does not fit any recorded graph key."""


class ReplayMismatchError(TrtgraphError):
    """A replay was asked with inputs that differ from what the graph recorded."""


class PromptError(TrtgraphError):
    """A prompts file line is malformed."""


class CaptureError(TrtgraphError):
    """Capture failed for a key (verification, memory, capture after lock)."""


class OutputPathError(TrtgraphError):
    """An output path is an input, an artifact or another output, or cannot be written."""


class RankLostError(TrtgraphError):
    """A tensor-parallel rank was ended from outside (a signal: the out-of-memory killer, kill -9)."""


class EngineClosedError(TrtgraphError, ValueError):
    """A call on an engine (or LLM) after its close(): nothing it held is left to serve with."""
