"""What runs beside the optimizer: the publisher (diff, encode, sign, upload a version per
step, resume a store that holds versions), its sharded form (one per trainer rank, each
publishing the rows it holds: ``sharded``, ``shards``), the delta pipeline every writer of a
delta runs (``delta_pipeline``) and the builder that lays a version out as blobs and a manifest.
Reads the format and the stores; never the server side."""
