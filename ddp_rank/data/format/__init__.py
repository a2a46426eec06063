"""The shard-set format: ``manifest.json`` (its model and its checked parsing), the tar shards' layout, and what
the manifest alone tells (``shards info``, the requests a split's classes cost). Everything that reads or writes
shards agrees through here."""
