"""loadtest: realistic prompt traces and replay against a kvstore cluster."""
