"""The serving :class:`.engine.Engine`: continuous batching of many requests over one paged store
(scheduler, KV manager, model runner over packed ragged batches, hand-over between engines)."""
