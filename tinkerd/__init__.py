"""tinkerd: a self-hosted server for the Tinker post-training API."""

__version__ = "0.1.0"
