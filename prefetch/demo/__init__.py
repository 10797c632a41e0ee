"""What only ``prefetch demo``, the tests and the benchmark need: a local S3 server
(:mod:`.locals3`), generated model files (:mod:`.modelgen`) and the demo itself (:mod:`.run`)."""
