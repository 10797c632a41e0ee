"""What writes models somewhere else: an S3 mirror prefix, an OCI registry, a compile cache."""
