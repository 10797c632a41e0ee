"""Google Cloud Storage: ``gs://bucket/prefix``, read on the JSON API through the project's HTTP
seam, with credentials from google-auth. The declaration (:mod:`.backend`) imports nothing that
reads the network; the source (:mod:`.source`) and the credentials (:mod:`.auth`) are imported
when a source is opened."""
