"""Peer transfer between node agents (see node_agent/peer/serve.py for the protocol)."""
