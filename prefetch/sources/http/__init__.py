"""The HTTP plumbing the backends share: pooled transports, proxy credentials, status texts."""
