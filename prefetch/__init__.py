"""model-prefetch: a model-weight cache and pre-fetch agent for GPU nodes on Kubernetes."""

__version__ = "0.1.0"
