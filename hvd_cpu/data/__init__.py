"""From a DataFrame file to batches of tensors: read, turn into features, shard, batch."""
