"""The serving cluster in two rooms: `cluster.engine` (one engine replica: scheduler, engine core,
async loop) and `cluster.serving` (Ray Serve, OpenAI HTTP, gRPC, routing, autoscaling, CLI)."""
