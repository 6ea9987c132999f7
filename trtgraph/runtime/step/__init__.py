"""One step: typed buffers, attention metadata, the executor, graph replay, load checks, the sampler reference, the KV pool."""
