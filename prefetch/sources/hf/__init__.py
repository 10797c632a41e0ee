"""The Hugging Face Hub backend: its declaration (``backend``) and its source (``source``)."""
