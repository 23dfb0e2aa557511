"""The UCX transport of peer transfer."""
