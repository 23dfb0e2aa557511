"""Cache-aware router: a global block index built from the agents' event streams and a
pure cost function that picks the node to serve each prompt."""
