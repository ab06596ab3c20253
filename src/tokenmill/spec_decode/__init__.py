"""Speculative decoding: draft-token proposers and their verification against the target model."""
