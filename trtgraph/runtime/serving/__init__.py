"""Serving: requests in, scheduler, engine loop, drafter, the LLM API, streaming, run stats."""
