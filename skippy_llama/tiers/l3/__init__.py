"""L3: the durable disk tier, split into small modules (schema, store, health, pins, tree,
reader, writer, eviction, reconcile, stats, admin) behind the ``DiskTier`` façade, plus the pure
admission/eviction policies and the trace replay simulator."""
