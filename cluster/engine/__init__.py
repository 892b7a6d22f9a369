"""The engine room: configuration, requests, the scheduler, the engine core and its async loop,
outputs, detokenization and metrics. Imports: engine -> block_manager, engine -> workers."""
