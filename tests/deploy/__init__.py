"""What deploys the service: the compose stack, its parts, the Kubernetes manifests."""
