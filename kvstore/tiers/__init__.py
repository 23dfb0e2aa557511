"""Storage tiers: the device-memory pool and the NVMe tier on RocksDB."""
