"""Cluster coordination: the etcd module (membership, namespaces, tenants, kill switch)
and the local development cluster supervisor."""
