"""Coalescing of token streams: the stream-message budget (:mod:`.budget`) and the re-chunking
generator the servicer sends from (:mod:`.coalesce`)."""
