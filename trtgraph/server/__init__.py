"""`trtgraph serve`: an OpenAI-compatible HTTP server on the replay-only engine."""
