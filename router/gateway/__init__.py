"""The OpenAI-compatible cache-aware gateway, served by the router process
(`kvstore-router --gateway-listen HOST:PORT`) over the router's own RouterCore."""
