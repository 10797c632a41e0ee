"""The reader of an S3 mirror prefix (what ``prefetch mirror`` writes) and its format."""
