"""What runs beside the optimizer: the publisher (diff, encode, sign, upload a version per
step, resume a store that holds versions) and the builder that lays a version out as blobs
and a manifest. Reads the format and the stores; never the server side."""
