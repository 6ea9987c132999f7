"""Request and response shapes at the edges: OpenAI completions / chat / batch files <-> the
native requests and results. Pure translation; nothing here touches the engine."""
