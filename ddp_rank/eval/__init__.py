"""Retrieval evaluation: embedding of test shards, Recall@k / MAP@R, the datasets' protocols."""
