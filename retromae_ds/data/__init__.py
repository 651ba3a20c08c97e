"""Data: shard schema, preprocessing, memory-mapped reader and the distributed sampler."""
