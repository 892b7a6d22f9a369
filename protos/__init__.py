"""gRPC service definitions and their generated Python stubs."""
