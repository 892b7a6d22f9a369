"""The serving room: the Ray Serve app, the OpenAI and gRPC front ends, routing, the ingress,
autoscaling, Prometheus and the serve CLI. Imports: serving -> engine, serving -> protos."""
