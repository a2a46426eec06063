"""Reading shards: ranged reads from a directory or URL (retries, the node-local cache), classes checked against
the manifest, image decoding and transforms, the training stream and its loader, the evaluation reader, and
``shards serve``."""
