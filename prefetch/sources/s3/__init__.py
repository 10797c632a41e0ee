"""The S3 backend: its declaration (``backend``) and the source it opens (``source``)."""
