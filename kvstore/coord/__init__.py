"""Coordination through etcd: the one etcd module (membership, namespaces, tenants, kill
switch), the admin actions on top of it (atomic flush, quotas, audit) and what agents and
routers run to follow them."""
