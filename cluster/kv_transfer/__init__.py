"""Moving cached KV blocks between engine replicas: a replica admitting a request whose leading
blocks another replica holds pulls them instead of computing them (docs/routing.md, "Pulling a
prefix from a peer").

`hint` (the source hint a request may carry) and `payload` (what crosses the wire) import no
engine code, so the engine's request type can name them; the holder's exporter, the receiver's
puller, the cost model, the metrics and the transports live in modules of their own.
"""
