"""Making and checking shard sets: listings and dataset recipes, ``shards build``, ``shards index`` for shards of
other tools, ``shards reshard``, ``shards verify``, and small synthetic image collections."""
