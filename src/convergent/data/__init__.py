"""Dataset store: checksummed shards, streaming reader, node-local cache."""

