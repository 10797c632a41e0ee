"""The HTTP plumbing the backends share: pooled transports, the status table and errors, the
answer and its body reader, proxy credentials, status texts."""
